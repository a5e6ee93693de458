"""data=chat: a conversation rendered with a chat template into tokens and a loss mask.

A row is {<data.messages_field>: [{role, content}, ...]} or {prompt, completion}: strings
(one user turn, one assistant turn) or lists of messages (TRL's conversational
prompt-completion form). Roles: system, user, assistant, tool.

The mask has one byte per token: bit 0 (COUNTS) marks a token the loss counts as a target
(predicted from the tokens before it), bit 1 (START) the first token of a sample. A
sample's first token never counts (nothing of its sample precedes it).

Which tokens count (data.train_on): the assistant turns (assistant), the last assistant
turn or the completion (completion), or every token (all). Where the template marks the
assistant's tokens ({% generation %}), transformers' own apply_chat_template(...,
return_assistant_tokens_mask=True) gives them. Elsewhere (most real templates, Llama 3's
included) an assistant turn's tokens are those between the rendering of the conversation
before it with the generation prompt and the rendering through it: every rendering's
tokens must extend the one before (a template that rewrites earlier turns, such as one
that drops old reasoning, is refused: its mask cannot be told this way).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from launcher.config import ConfigError, DataConfig, TrainOn

ROLES = ("system", "user", "assistant", "tool")
COUNTS, START = 1, 2
VERSION = 1
"""Of the rendering and the mask: part of the cache key."""
GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
PROBE = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]


class RowError(ValueError):
    """What is wrong with one row; the caller names the file and the line. `key`: the
    setting to blame when it is not the row (the template)."""

    def __init__(self, message: str, key: tuple[str, str] | None = None):
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class Template:
    text: str
    key: tuple[str, str]
    """Where it comes from, as (key, value): data.chat_template, or data.tokenizer."""

    @property
    def marks_generation(self) -> bool:
        return bool(GENERATION.search(self.text))

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else type(err).__name__


def load_template(d: DataConfig, tok) -> Template:
    """data.chat_template's file, else the tokenizer's own template; refused in one line
    when there is none, or when it does not render a two-turn conversation."""
    if d.chat_template:
        path = Path(d.chat_template).expanduser()
        if not path.is_file():
            raise ConfigError(
                "data.chat_template",
                d.chat_template,
                "no such file (a Jinja chat template, e.g. a chat_template.jinja), or null: the tokenizer's own",
            )
        template = Template(path.read_text(encoding="utf-8"), ("data.chat_template", d.chat_template))
    else:
        try:
            text = tok.get_chat_template()
        except ValueError as err:  # none, or several and no default
            raise ConfigError(
                "data.tokenizer",
                d.tokenizer,
                f"has no chat template to render conversations with "
                f"({first_line(err)[:120]}); name one: data.chat_template=<file.jinja>",
            )
        template = Template(text, ("data.tokenizer", d.tokenizer))
    try:
        texts(tok, template, [(PROBE, False)])
    except Exception as err:  # jinja2's TemplateError and whatever the template raises
        raise ConfigError(
            *template.key, f"its chat template does not render a user and an assistant turn ({first_line(err)})"
        )
    return template


def settings(d: DataConfig, tok) -> dict:
    """data=chat's part of a preparation (launcher/data/cache.py): `key` (in the cache key
    and the index: what changes the tokens or the mask besides the files and the
    tokenizer) and `job` (what each worker renders with)."""
    template = load_template(d, tok.tok)
    return {
        "key": {
            "kind": "chat",
            "rendering": VERSION,
            "template_sha256": template.digest,
            "train_on": d.train_on.value,
            "messages_field": d.messages_field,
        },
        "job": {
            "kind": "chat",
            "template": template.text,
            "template_key": list(template.key),
            "train_on": d.train_on.value,
            "field": d.messages_field,
        },
    }


# ----------------------------------------------------------------------------- rows
def conversation(row, field: str, train_on: TrainOn) -> tuple[list[dict], list[int]]:
    """The messages of a row, and the indices of the assistant turns that count."""
    if not isinstance(row, dict):
        raise RowError("is not a JSON object (one conversation per line)")
    completion_at = None
    if row.get(field) is not None:
        messages = row[field]
    elif row.get("prompt") is not None and row.get("completion") is not None:
        prompt, completion = (
            as_messages(row[k], role, k) for k, role in (("prompt", "user"), ("completion", "assistant"))
        )
        messages, completion_at = prompt + completion, len(prompt)
    else:
        raise RowError(f"has no `{field}` field (data.messages_field), nor `prompt` and `completion`")
    if not isinstance(messages, list) or not messages:
        raise RowError(f"`{field}` is not a list of messages")
    for k, m in enumerate(messages, 1):
        if not isinstance(m, dict) or "role" not in m:
            raise RowError(f"message {k} is not an object with a role and a content")
        if m["role"] not in ROLES:
            raise RowError(f"message {k} has the role {m['role']!r}; allowed roles: {', '.join(ROLES)}")
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if train_on == TrainOn.completion:
        turns = [i for i in turns if i >= completion_at] if completion_at is not None else turns[-1:]
    if not turns and train_on != TrainOn.all:
        raise RowError(
            f"has no assistant turn to train on (data.train_on={train_on.value}); data.train_on=all "
            "trains on every token"
        )
    return messages, turns


def as_messages(value, role: str, name: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        return value
    raise RowError(f"`{name}` is a {type(value).__name__}: a string or a list of messages")


# ----------------------------------------------------------------------------- rendering
def texts(tok, template: Template, conversations: list[tuple[list[dict], bool]]) -> list[str]:
    """Each (messages, add_generation_prompt) rendered as apply_chat_template renders it
    (the tokenizer's special tokens in the template's variables); an empty conversation too."""
    # local: optional (transformers, after offline())
    from transformers.utils.chat_template_utils import render_jinja_template

    out = []
    for messages, generation in conversations:
        rendered, _ = render_jinja_template(
            conversations=[messages],
            chat_template=template.text,
            add_generation_prompt=generation,
            **tok.special_tokens_map,
        )
        out.append(rendered[0])
    return out


def encode(tok, rendered: list[str]) -> list[list[int]]:
    """As apply_chat_template tokenizes a rendering: the template holds the special tokens."""
    return [tok(text, add_special_tokens=False)["input_ids"] for text in rendered]


def render(
    tok, template: Template, messages: list[dict], turns: list[int], train_on: TrainOn, by_prefix: bool | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """A conversation's tokens and mask (COUNTS and START bits). `by_prefix`: how the
    assistant's tokens are found (None: transformers' mask where the template marks them)."""
    if by_prefix is None:
        by_prefix = not (template.marks_generation and tok.is_fast)
    try:
        if train_on == TrainOn.all:
            ids, counts = encode(tok, texts(tok, template, [(messages, False)]))[0], None
        elif by_prefix:
            ids, counts = prefix_mask(tok, template, messages, turns)
        else:
            ids, counts = generation_mask(tok, template, messages, turns)
    except RowError:
        raise
    except Exception as err:  # jinja2's errors, raise_exception in the template, a content it cannot take
        raise RowError(f"the chat template ({'='.join(template.key)}) does not render it: {first_line(err)}")
    if not ids:
        raise RowError("renders to no tokens")
    mask = np.full(len(ids), COUNTS, dtype=np.uint8) if counts is None else counts.astype(np.uint8) * COUNTS
    mask[0] = START  # nothing of the sample precedes its first token
    return np.asarray(ids, dtype=np.int64), mask


def generation_mask(tok, template: Template, messages: list[dict], turns: list[int]) -> tuple[list[int], np.ndarray]:
    """transformers' assistant mask; for a subset of the assistant turns (train_on=completion),
    only the part after the conversation before the first of them."""
    out = tok.apply_chat_template(
        messages, chat_template=template.text, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, counts = list(out["input_ids"]), np.asarray(out["assistant_masks"], dtype=bool)
    everyone = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if turns != everyone:
        before = encode(tok, texts(tok, template, [(messages[: turns[0]], False)]))[0]
        if ids[: len(before)] != before:
            raise not_prefix(template, turns[0])
        counts[: len(before)] = False
    return ids, counts


def prefix_mask(tok, template: Template, messages: list[dict], turns: list[int]) -> tuple[list[int], np.ndarray]:
    """The assistant turns' tokens by rendering prefix by prefix: for turn i, from the end of
    messages[:i] with the generation prompt to the end of messages[:i + 1]. The renderings
    must extend each other as text; a fast tokenizer then maps those character spans onto
    the whole conversation's tokens (a token counts where it starts inside a span), so a
    tokenizer that merges a prompt's last character with the reply's first (ChatML's
    newlines under Qwen's pre-tokenizer) is no reason to refuse; a slow one compares the
    renderings' tokens, which must extend each other too."""
    wanted = [(messages[:i], True) for i in turns] + [(messages[: i + 1], False) for i in turns] + [(messages, False)]
    rendered = texts(tok, template, wanted)
    n = len(turns)
    chain = [x for pair in zip(rendered[:n], rendered[n : 2 * n]) for x in pair] + [rendered[-1]]
    for k in range(len(chain) - 1):
        if not chain[k + 1].startswith(chain[k]):
            raise not_prefix(template, turns[k // 2] + (k % 2))
    if tok.is_fast:
        out = tok(rendered[-1], add_special_tokens=False, return_offsets_mapping=True)
        ids, starts = out["input_ids"], np.asarray([a for a, _ in out["offset_mapping"]])
        counts = np.zeros(len(ids), dtype=bool)
        for start, end in zip(rendered[:n], rendered[n : 2 * n]):
            counts |= (starts >= len(start)) & (starts < len(end))
        return ids, counts
    encoded = encode(tok, rendered)
    ids, counts = encoded[-1], np.zeros(len(encoded[-1]), dtype=bool)
    id_chain = [x for pair in zip(encoded[:n], encoded[n : 2 * n]) for x in pair] + [ids]
    for k in range(len(id_chain) - 1):
        if id_chain[k + 1][: len(id_chain[k])] != id_chain[k]:
            raise not_prefix(template, turns[k // 2] + (k % 2))
    for first, last in zip(encoded[:n], encoded[n : 2 * n]):
        counts[len(first) : len(last)] = True
    return ids, counts


def not_prefix(template: Template, turn: int) -> RowError:
    return RowError(
        f"the template's tokens of the conversation through message {turn + 1} do not extend those of "
        "the messages before it (the template rewrites earlier turns), so the assistant's tokens cannot "
        "be told; a template that marks them with {% generation %} can (data.chat_template=<file>)",
        key=template.key,
    )

"""Chat data and a tiny chat model for the tests: scripts/tiny_chat.py's (the shipped
example's generator and the model a user makes), in session folders."""

from __future__ import annotations

import sys
from functools import lru_cache
from pathlib import Path

from hf_models import session_folder
from runs import REPO

sys.path.insert(0, str(REPO / "scripts"))
from tiny_chat import SPECIAL, TEMPLATE, rows, vocabulary, write_data, write_model, write_tokenizer  # noqa: E402

EXAMPLE = REPO / "examples" / "chat" / "train.jsonl"
__all__ = [
    "EXAMPLE",
    "SPECIAL",
    "TEMPLATE",
    "chat_model",
    "chat_tokenizer",
    "rows",
    "vocabulary",
    "write_data",
    "write_model",
    "write_tokenizer",
]


@lru_cache(maxsize=None)
def chat_tokenizer() -> Path:
    """The tiny chat model's tokenizer (its template marks generation), once per session."""
    return write_tokenizer(session_folder("launcher-chat-tok-") / "tok")


@lru_cache(maxsize=None)
def chat_model() -> Path:
    """The tiny Llama and its tokenizer in one folder, once per session."""
    return write_model(session_folder("launcher-chat-model-") / "model")


def bad_chat_files() -> dict[str, Path]:
    """Inputs for the bad-input table, made once per test session: JSON-lines files whose
    line 2 (or 3) is wrong, a tokenizer folder without a chat template, and templates that
    raise on a system turn or rewrite earlier turns."""
    from corpus import make_tokenizer

    root = session_folder("launcher-chat-bad-")
    good = {"messages": [{"role": "user", "content": "What is 1 + 1 ?"}, {"role": "assistant", "content": "2"}]}
    two = {"messages": good["messages"] * 2}
    system = {"messages": [{"role": "system", "content": "Answer with the result only ."}, *good["messages"]]}
    lines = {
        "no_assistant.jsonl": [good, {"messages": [{"role": "user", "content": "hi"}]}],
        "robot.jsonl": [good, good, {"messages": [{"role": "robot", "content": "hi"}, good["messages"][1]]}],
        "system.jsonl": [good, good, system],
        "no_field.jsonl": [good, {"conversation": good["messages"]}],
        "two_turns.jsonl": [two],
        "text.jsonl": [{"text": "a document"}],
    }
    import json

    for name, values in lines.items():
        (root / name).write_text("".join(json.dumps(v) + "\n" for v in values))
    (root / "raises.jinja").write_text(
        TEMPLATE.replace(
            "{% for message in messages %}",
            "{% for message in messages %}{% if message['role'] == 'system' %}"
            "{{ raise_exception('this template takes no system turn') }}{% endif %}",
        )
    )
    plain = TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    (root / "rewrites.jinja").write_text(
        plain.replace(
            "{{ message['content'] }}<|end|>{% else %}",
            "{% if loop.last %}{{ message['content'] }}{% endif %}<|end|>{% else %}",
        )
    )
    make_tokenizer(root / "bare_tokenizer", ["a", "b"])
    return {p.name: p for p in root.iterdir()}

"""A small chat data set and a tiny chat model, made here (nothing downloaded).

    python scripts/tiny_chat.py data examples/chat/train.jsonl   # the shipped file (seed 0)
    python scripts/tiny_chat.py model /tmp/tiny-chat             # a Llama folder + its tokenizer

`data`: JSON lines of {"messages": [...]}, learnable tasks in user/assistant turns (sums
and differences of small numbers, reversing, sorting and counting words), a system turn
in some rows, a second exchange in some. `model`: a tiny LlamaForCausalLM written by
save_pretrained (config.json, model.safetensors) and, in the same folder, a word-level
tokenizer built with the `tokenizers` library whose chat template marks the assistant's
tokens with {% generation %}: the folder is both `model.pretrained` and `data.tokenizer`:

    make data ARGS="data=chat data.files=examples/chat/train.jsonl data.tokenizer=/tmp/tiny-chat"
    make train ARGS="data=chat data.files=examples/chat/train.jsonl data.tokenizer=/tmp/tiny-chat \\
                     model=hf model.pretrained=/tmp/tiny-chat train.seq_len=128"
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = (
    "red blue green black white pink gold gray cat dog fox owl bee ant cow hen sun moon star rain snow wind "
    "tree leaf rock sand lake hill road ship"
).split()
SYSTEMS = ("You are a careful assistant .", "Answer with the result only .", "You are good at numbers and words .")
PROMPT_WORDS = "What is Reverse Sort Count the words : How many are there in ? + - = And now".split()
SPECIAL = ["<unk>", "<pad>", "<bos>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"]
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|assistant|>"
    "{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}"
    "{% else %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""Every turn ends with <|end|>; the assistant's content and its <|end|> are generated."""
LLAMA = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    tie_word_embeddings=False,
    initializer_range=0.125,
)


def vocabulary() -> list[str]:
    """Every token the data and the template use, in a fixed order."""
    words = [str(n) for n in range(0, 100)] + list(WORDS) + PROMPT_WORDS
    words += [w for s in SYSTEMS for w in s.split()]
    return SPECIAL + list(dict.fromkeys(w for w in words if w not in SPECIAL))


def exchange(r: random.Random) -> tuple[str, str]:
    """One question and its answer, words separated by spaces (the tokenizer splits there)."""
    kind = r.choice(("add", "sub", "reverse", "sort", "count"))
    if kind in ("add", "sub"):
        a, b = r.randint(0, 49), r.randint(0, 49)
        if kind == "sub":
            a, b = max(a, b), min(a, b)
        op, value = ("+", a + b) if kind == "add" else ("-", a - b)
        return f"What is {a} {op} {b} ?", f"{a} {op} {b} = {value}"
    words = r.sample(WORDS, r.randint(2, 5))
    if kind == "reverse":
        return f"Reverse the words : {' '.join(words)}", " ".join(reversed(words))
    if kind == "sort":
        return f"Sort the words : {' '.join(words)}", " ".join(sorted(words))
    return f"How many words are there in : {' '.join(words)}", str(len(words))


def rows(n: int, seed: int = 0) -> list[dict]:
    r = random.Random(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": r.choice(SYSTEMS)}] if r.random() < 0.3 else []
        for turn in range(2 if r.random() < 0.25 else 1):
            question, answer = exchange(r)
            messages += [
                {"role": "user", "content": ("And now " if turn else "") + question},
                {"role": "assistant", "content": answer},
            ]
        out.append({"messages": messages})
    return out


def write_data(path: Path, n: int = 3000, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows(n, seed)))
    return path


def write_tokenizer(folder: Path, template: str = TEMPLATE) -> Path:
    """A word-level tokenizer (whitespace and punctuation split) with the chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        additional_special_tokens=SPECIAL[4:],
    )
    fast.chat_template = template
    fast.save_pretrained(str(folder))
    return folder


def write_model(folder: Path, seed: int = 0, **shape) -> Path:
    """A tiny Llama (save_pretrained: config.json, model.safetensors) over the tokenizer's
    vocabulary, and the tokenizer beside it."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder.mkdir(parents=True, exist_ok=True)
    write_tokenizer(folder)
    ids = {w: i for i, w in enumerate(vocabulary())}
    config = LlamaConfig(
        vocab_size=len(ids),
        bos_token_id=ids["<bos>"],
        eos_token_id=ids["<eos>"],
        pad_token_id=ids["<pad>"],
        **{**LLAMA, **shape},
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(folder))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["data", "model"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--rows", type=int, default=3000, help="data: conversations")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.what == "data":
        print(write_data(args.out, args.rows, args.seed))
    else:
        print(write_model(args.out, args.seed))


if __name__ == "__main__":
    main()

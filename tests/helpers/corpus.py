"""Small text corpora and a tokenizer trained here (nothing downloaded), for data=hf_text."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from launcher.data.prepare import POINTER

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven small ducks swim across the cold "
    "river and nobody sees them except an old owl sitting on a branch"
).split()


def documents(n: int, seed: int = 0) -> list[str]:
    r = random.Random(seed)
    docs = [" ".join(r.choice(WORDS) for _ in range(r.randint(4, 40))) for _ in range(n)]
    docs[1] = "naïve café, ünïcode — 日本語"  # more than one byte per character
    return docs


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)))
    return path


def write_parquet(path: Path, docs: list[str]) -> Path:
    pq.write_table(pa.table({"id": list(range(len(docs))), "body": docs}), path)
    return path


def make_tokenizer(folder: Path, words: list[str]) -> Path:
    """A word-level tokenizer folder, trained here (nothing downloaded), as a user's would be."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(words)], trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>").save_pretrained(str(folder))
    return folder


def cached_tokens(run_dir: Path) -> tuple[np.ndarray, dict]:
    """The tokens of the prepared directory RUN_DIR/data/hf_text.json names (in the shared
    cache), and its index with the pointer's `dir`."""
    from launcher.data.cache import read_tokens

    pointer = json.loads((run_dir / "data" / POINTER).read_text())
    tokens, index = read_tokens(Path(pointer["dir"]))
    return tokens, {**index, "dir": pointer["dir"]}

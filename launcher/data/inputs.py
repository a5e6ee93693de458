"""The inputs of data=hf_text: the files the globs name, their format and fields, and the
tokenizers (the project's byte encoding, or a local folder AutoTokenizer loads offline).
Read by the launch side's checks (launcher/data/prepare.py) and by the preparation's
processes (launcher/data/cache.py, units.py)."""

from __future__ import annotations

import glob
import itertools
import json
import os
from functools import lru_cache
from pathlib import Path

import numpy as np

from launcher import offline
from launcher.config import ConfigError, DataConfig, TextFormat, TokenDtype
from launcher.remote_code import remote_code

BYTE_VOCAB = 256
BYTE_EOS = 255
"""End of document for the byte tokenizer: 0xFF never occurs in UTF-8 text, so the
vocabulary stays the project's 256 (scripts/prepare_data.py, the gpt configs' byte models)."""
EXTENSIONS = {
    ".jsonl": TextFormat.json,
    ".json": TextFormat.json,
    ".parquet": TextFormat.parquet,
    ".txt": TextFormat.text,
    ".text": TextFormat.text,
}
# A model folder holds the tokenizer beside the weights; the weights are not the tokenizer's identity.
WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt"}


# ----------------------------------------------------------------------------- files
def patterns(d: DataConfig) -> list[str]:
    if d.files is None or d.files == "???":
        raise ConfigError(
            "data.files", None, f"missing: data={d.name.value} needs data.files='corpus/*.jsonl' (a glob or a list)"
        )
    items = [d.files] if isinstance(d.files, str) else list(d.files) if isinstance(d.files, (list, tuple)) else None
    if not items or not all(isinstance(p, str) and p for p in items):
        raise ConfigError("data.files", d.files, "a glob or a list of globs of local files")
    return items


def resolve_files(d: DataConfig) -> list[Path]:
    """Every file the globs match, in sorted order per glob, each once."""
    files: list[Path] = []
    for pattern in patterns(d):
        matched = sorted(
            Path(p).resolve() for p in glob.glob(os.path.expanduser(pattern), recursive=True) if Path(p).is_file()
        )
        if not matched:
            raise ConfigError(
                "data.files", pattern, "matches no file (a glob of local .jsonl, .json, .parquet, .txt files)"
            )
        files += [f for f in matched if f not in files]
    return files


def file_format(d: DataConfig, files: list[Path]) -> TextFormat:
    if d.format != TextFormat.auto:
        return d.format
    found = {f: EXTENSIONS.get(f.suffix.lower()) for f in files}
    unknown = [f for f, fmt in found.items() if fmt is None]
    if unknown:
        raise ConfigError(
            "data.format",
            "auto",
            f"cannot tell the format of {unknown[0]} from its extension; name it: data.format=json|parquet|text",
        )
    kinds = sorted({fmt.value for fmt in found.values()})
    if len(kinds) > 1:
        raise ConfigError(
            "data.files", ",".join(patterns(d)), f"mixes formats ({', '.join(kinds)}); one format per run"
        )
    return next(iter(found.values()))


def fields_of(path: Path, fmt: TextFormat) -> list[str] | None:
    """The columns of one file (None: an empty file, nothing to check)."""
    if fmt == TextFormat.text:
        return ["text"]
    if fmt == TextFormat.parquet:
        import pyarrow.parquet as pq  # local: optional (pyarrow)

        try:
            return list(pq.read_schema(path).names)
        except Exception as err:  # pyarrow raises its own types for a file that is not parquet
            raise ConfigError("data.files", str(path), f"not a parquet file ({str(err).splitlines()[0]})")
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    row = None
                if not isinstance(row, dict):
                    raise ConfigError(
                        "data.files",
                        str(path),
                        f"line {number} is not a JSON object (JSON lines expected: one object per line)",
                    )
                return list(row)
    return None


# ----------------------------------------------------------------------------- tokenizers
class ByteTokenizer:
    """UTF-8 bytes as tokens; documents end with 0xFF."""

    vocab_size = BYTE_VOCAB
    eos_id = BYTE_EOS
    identity = "byte"

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def pack(self, texts: list[str], dtype) -> np.ndarray:
        """The documents' tokens, each followed by EOS, as one array (0xFF joins them: no
        UTF-8 text holds that byte)."""
        joined = b"\xff".join(t.encode("utf-8") for t in texts) + b"\xff"
        return np.frombuffer(joined, dtype=np.uint8).astype(dtype)


class LocalTokenizer:
    """A tokenizer folder AutoTokenizer loads without the network; its EOS ends documents."""

    def __init__(self, path: Path):
        from transformers import AutoTokenizer  # local: optional (transformers, after offline())

        code = remote_code(path)
        if code:
            raise ConfigError("data.tokenizer", str(path), code)
        try:
            self.tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
        except Exception as err:  # transformers raises OSError, ValueError, KeyError... for a bad folder
            reason = str(err).strip().splitlines()[0] if str(err).strip() else err.__class__.__name__
            raise ConfigError(
                "data.tokenizer", str(path), f"not a tokenizer AutoTokenizer loads offline ({reason[:200]})"
            )
        self.vocab_size = len(self.tok)
        self.eos_id = self.tok.eos_token_id
        if self.eos_id is None:
            raise ConfigError(
                "data.tokenizer",
                str(path),
                "the tokenizer has no eos_token to end documents with; set one in its tokenizer_config.json",
            )
        files = sorted(
            (p.name, p.stat().st_size, p.stat().st_mtime_ns)
            for p in path.iterdir()
            if p.is_file() and p.suffix not in WEIGHT_SUFFIXES
        )
        self.identity = {"path": str(path), "files": files}

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.int64) for ids in self.tok(texts, add_special_tokens=False)["input_ids"]]

    def pack(self, texts: list[str], dtype) -> np.ndarray:
        ids = self.tok(texts, add_special_tokens=False)["input_ids"]
        eos = (self.eos_id,)
        count = sum(map(len, ids)) + len(ids)
        return np.fromiter(
            itertools.chain.from_iterable(itertools.chain.from_iterable(zip(ids, itertools.repeat(eos)))),
            dtype=dtype,
            count=count,
        )


@lru_cache(maxsize=4)
def load_tokenizer(spec: str) -> ByteTokenizer | LocalTokenizer:
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec).expanduser().resolve()
    if not path.exists():
        raise ConfigError("data.tokenizer", spec, "no such folder; allowed: byte, or a local tokenizer folder")
    if not path.is_dir():
        raise ConfigError("data.tokenizer", spec, "not a folder; allowed: byte, or a local tokenizer folder")
    offline()
    return LocalTokenizer(path)


def token_dtype(tok) -> TokenDtype:
    return TokenDtype.uint16 if tok.vocab_size <= 2**16 else TokenDtype.uint32

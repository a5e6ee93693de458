"""data=hf_text: local JSON lines, parquet or plain text through `datasets`, tokenized once.

The launch side checks the files, the field and the tokenizer before anything is made
(`validate_hf_text`, bad input exits 2), then tokenizes every document, appends the end-
of-document token and writes one flat token file into the run directory
(`prepare_cache`), before any rank starts. The ranks only memory-map that file: it is
`data=memmap`'s format, so they read it through the same TokenFile (windows of seq_len + 1
tokens in a seeded order per epoch) and the same global-sample-index sampler, and a
resume continues at the exact sample. Nothing is fetched: the hub's offline switches are
set, files and tokenizers are local paths.

The cache lives in RUN_DIR/data/hf_text-<key>/ (tokens.bin, meta.json); RUN_DIR/data/
hf_text.json names the one this run reads. The key covers the files (path, size, mtime),
the format and field, the tokenizer (its files' sizes and mtimes) and train.seq_len: a
relaunch with the same inputs reuses the cache, any change rebuilds it.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import shutil
import time
from functools import lru_cache
from pathlib import Path

import numpy as np

from launcher import offline
from launcher.config import Config, ConfigError, DataConfig, TextFormat, TokenDtype
from launcher.models import model_vocab_size

CACHE_VERSION = 1
POINTER = "hf_text.json"
BYTE_VOCAB = 256
BYTE_EOS = 255
"""End of document for the byte tokenizer: 0xFF never occurs in UTF-8 text, so the
vocabulary stays the project's 256 (scripts/prepare_data.py, the gpt configs' byte models)."""
EXTENSIONS = {".jsonl": TextFormat.json, ".json": TextFormat.json, ".parquet": TextFormat.parquet,
              ".txt": TextFormat.text, ".text": TextFormat.text}
# A model folder holds the tokenizer beside the weights; the weights are not the tokenizer's identity.
WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt"}
BATCH = 1000


# ----------------------------------------------------------------------------- files
def patterns(d: DataConfig) -> list[str]:
    if d.files is None or d.files == "???":
        raise ConfigError("data.files", None, "missing: data=hf_text needs data.files='corpus/*.jsonl' (a glob or a list)")
    items = [d.files] if isinstance(d.files, str) else list(d.files) if isinstance(d.files, (list, tuple)) else None
    if not items or not all(isinstance(p, str) and p for p in items):
        raise ConfigError("data.files", d.files, "a glob or a list of globs of local files")
    return items


def resolve_files(d: DataConfig) -> list[Path]:
    """Every file the globs match, in sorted order per glob, each once."""
    files: list[Path] = []
    for pattern in patterns(d):
        matched = sorted(Path(p).resolve() for p in glob.glob(os.path.expanduser(pattern), recursive=True)
                         if Path(p).is_file())
        if not matched:
            raise ConfigError("data.files", pattern, "matches no file (a glob of local .jsonl, .json, .parquet, .txt files)")
        files += [f for f in matched if f not in files]
    return files


def file_format(d: DataConfig, files: list[Path]) -> TextFormat:
    if d.format != TextFormat.auto:
        return d.format
    found = {f: EXTENSIONS.get(f.suffix.lower()) for f in files}
    unknown = [f for f, fmt in found.items() if fmt is None]
    if unknown:
        raise ConfigError("data.format", "auto", f"cannot tell the format of {unknown[0]} from its extension; "
                          f"name it: data.format=json|parquet|text")
    kinds = sorted({fmt.value for fmt in found.values()})
    if len(kinds) > 1:
        raise ConfigError("data.files", ",".join(patterns(d)), f"mixes formats ({', '.join(kinds)}); one format per run")
    return next(iter(found.values()))


def fields_of(path: Path, fmt: TextFormat) -> list[str] | None:
    """The columns of one file (None: an empty file, nothing to check)."""
    if fmt == TextFormat.text:
        return ["text"]
    if fmt == TextFormat.parquet:
        import pyarrow.parquet as pq

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
                    raise ConfigError("data.files", str(path), f"line {number} is not a JSON object (JSON lines expected: "
                                      "one object per line)")
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


class LocalTokenizer:
    """A tokenizer folder AutoTokenizer loads without the network; its EOS ends documents."""

    def __init__(self, path: Path):
        from transformers import AutoTokenizer

        try:
            self.tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as err:  # transformers raises OSError, ValueError, KeyError... for a bad folder
            reason = str(err).strip().splitlines()[0] if str(err).strip() else err.__class__.__name__
            raise ConfigError("data.tokenizer", str(path), f"not a tokenizer AutoTokenizer loads offline ({reason[:200]})")
        self.vocab_size = len(self.tok)
        self.eos_id = self.tok.eos_token_id
        if self.eos_id is None:
            raise ConfigError("data.tokenizer", str(path), "the tokenizer has no eos_token to end documents with; "
                              "set one in its tokenizer_config.json")
        files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir()
                       if p.is_file() and p.suffix not in WEIGHT_SUFFIXES)
        self.identity = {"path": str(path), "files": files}

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.int64) for ids in self.tok(texts, add_special_tokens=False)["input_ids"]]


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


# ----------------------------------------------------------------------------- launch side
def validate_hf_text(cfg: Config) -> None:
    """Files, field, tokenizer and vocabulary, checked before anything is written."""
    offline()
    d = cfg.data
    files = resolve_files(d)
    fmt = file_format(d, files)
    for f in files:
        fields = fields_of(f, fmt)
        if fields is not None and d.text_field not in fields:
            where = "plain text files have only `text`" if fmt == TextFormat.text else f"its fields: {', '.join(fields)}"
            raise ConfigError("data.text_field", d.text_field, f"not a field of {f}; {where}")
    tok = load_tokenizer(d.tokenizer)
    rows = model_vocab_size(cfg)
    if tok.vocab_size > rows:
        raise ConfigError("data.tokenizer", d.tokenizer, f"its vocabulary of {tok.vocab_size} tokens is larger than the "
                          f"model's embedding (model.vocab_size={rows}); use a model with at least {tok.vocab_size} rows")


def cache_key(cfg: Config, files: list[Path], fmt: TextFormat, tok) -> str:
    stats = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    what = {"version": CACHE_VERSION, "files": stats, "format": fmt.value, "text_field": cfg.data.text_field,
            "tokenizer": tok.identity, "eos": tok.eos_id, "seq_len": cfg.train.seq_len}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def prepare_cache(cfg: Config, run_dir: Path) -> str:
    """Tokenize and pack the files into RUN_DIR/data (or reuse the cache when its key is
    unchanged); point RUN_DIR/data/hf_text.json at it. Returns one line for the console."""
    d = cfg.data
    files = resolve_files(d)
    fmt = file_format(d, files)
    tok = load_tokenizer(d.tokenizer)
    key = cache_key(cfg, files, fmt, tok)
    root = run_dir / "data"
    final = root / f"hf_text-{key}"
    meta_path = final / "meta.json"
    reused = meta_path.is_file()
    t0 = time.perf_counter()
    if not reused:
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            meta = _tokenize(cfg, files, fmt, tok, tmp / "tokens.bin")
            meta["key"] = key
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
            try:
                os.rename(tmp, final)
            except OSError:  # another node's launcher made the same cache first
                if not meta_path.is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    meta = json.loads(meta_path.read_text())
    pointer = root / POINTER
    previous = json.loads(pointer.read_text())["dir"] if pointer.is_file() else None
    tmp_pointer = root / f".{POINTER}.tmp-{os.getpid()}"
    tmp_pointer.write_text(json.dumps({"dir": final.name, **meta}, indent=1) + "\n")
    os.replace(tmp_pointer, pointer)
    for old in root.glob("hf_text-*"):  # a stale cache of earlier inputs: never read again
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    seq_len = cfg.train.seq_len
    if meta["tokens"] < seq_len + 1:
        raise ConfigError("data.files", ",".join(patterns(d)), f"hold {meta['tokens']} tokens once tokenized; "
                          f"train.seq_len={seq_len} needs at least {seq_len + 1}")
    how = "reused" if reused else f"built in {time.perf_counter() - t0:.1f} s"
    changed = " (inputs changed since the last launch)" if previous not in (None, final.name) else ""
    return (f"data: {meta['documents']:,} documents, {meta['tokens']:,} tokens, "
            f"{(meta['tokens'] - 1) // seq_len:,} sequences of {seq_len}; cache {final} {how}{changed}")


def _tokenize(cfg: Config, files: list[Path], fmt: TextFormat, tok, out: Path) -> dict:
    """Stream the documents through `datasets` (no arrow copy of the corpus), write tokens."""
    offline()  # before datasets (and huggingface_hub) first import: they read it once
    import datasets

    datasets.disable_progress_bars()
    field = cfg.data.text_field
    dtype = np.uint16 if tok.vocab_size <= 2**16 else np.uint32
    eos = np.asarray([tok.eos_id], dtype=dtype)
    documents = tokens = 0
    with open(out, "wb") as f:
        for path in files:  # one file at a time: a read error names its file
            stream = datasets.load_dataset(fmt.value, data_files=[str(path)], split="train", streaming=True)
            try:
                for batch in stream.select_columns([field]).iter(batch_size=BATCH):
                    texts = batch[field]
                    bad = next((t for t in texts if t is not None and not isinstance(t, str)), None)
                    if bad is not None:
                        raise ConfigError("data.text_field", field, f"{path} holds a {type(bad).__name__} in it, not text")
                    texts = [t for t in texts if t]  # empty documents add nothing
                    for ids in tok.encode(texts):
                        f.write(ids.astype(dtype).tobytes())
                        f.write(eos.tobytes())
                        tokens += len(ids) + 1
                    documents += len(texts)
            except ConfigError:
                raise
            except Exception as err:  # a malformed row deep in a file: datasets/pyarrow errors
                raise ConfigError("data.files", str(path), f"cannot be read ({str(err).strip().splitlines()[0][:200]})")
    return {"files": [str(p) for p in files], "format": fmt.value, "text_field": field,
            "tokenizer": cfg.data.tokenizer, "vocab_size": tok.vocab_size, "eos_id": int(tok.eos_id),
            "dtype": TokenDtype.uint16.value if dtype == np.uint16 else TokenDtype.uint32.value,
            "documents": documents, "tokens": tokens, "seq_len": cfg.train.seq_len}


# ----------------------------------------------------------------------------- rank side
def token_file_config(cfg: Config, run_dir: Path) -> DataConfig:
    """The rank's view: the cache as a memmap token file (path and width)."""
    pointer = run_dir / "data" / POINTER
    if not pointer.is_file():
        raise FileNotFoundError(f"{pointer}: no token cache; launch through `launcher train`, which makes it")
    meta = json.loads(pointer.read_text())
    return dataclasses.replace(cfg.data, path=str(run_dir / "data" / meta["dir"] / "tokens.bin"),
                               dtype=TokenDtype(meta["dtype"]))

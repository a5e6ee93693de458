"""data=hf_text: local JSON lines, parquet or plain text, tokenized once into a shared cache;
data=chat: conversations rendered with a chat template into tokens and a loss mask, the same
way (launcher/data/chat.py), read as packed windows of whole samples (packing.py).

The launch side checks the files, the field and the tokenizer before anything is made
(`validate_hf_text`, bad input exits 2), then prepares the data (`prepare_cache`, or `make
data` alone): every document tokenized, the end-of-document token after each, by a pool
of processes over work units, into a content-addressed directory of the shared cache
(launcher/data/cache.py: index.json and shard_*.bin; the key covers the files' contents,
not their paths or train.seq_len). RUN_DIR/data/hf_text.json names the directory a run
reads; the ranks read it as a prepared token stream (launcher/data/sources.py: windows
of seq_len + 1 tokens cut inside each shard, in a seeded order per epoch), so a resume
continues at the exact sample. Nothing is fetched: the hub's offline switches are set,
files and tokenizers are local paths.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from launcher import offline
from launcher.config import (
    Config,
    ConfigError,
    DataConfig,
    DataKind,
    Scheduler,
    TextFormat,
    TokenDtype,
    held_out_windows,
)
from launcher.data.cache import INDEX, cache_root, describe, prepare
from launcher.data.chat import load_template
from launcher.data.inputs import fields_of, file_format, load_tokenizer, patterns, resolve_files
from launcher.data.packing import Packed
from launcher.data.sources import indexed
from launcher.data.units import write_json_atomic
from launcher.host import usable_cores
from launcher.models import model_vocab_size

POINTER = "hf_text.json"


# ----------------------------------------------------------------------------- launch side
def validate_prepare_fields(cfg: Config) -> None:
    """data.num_proc, data.shard_mb, data.cache_dir: the preparation's own fields."""
    d = cfg.data
    if d.num_proc is not None and d.num_proc < 1:
        raise ConfigError(
            "data.num_proc", d.num_proc, f"must be >= 1 (or null: the {usable_cores()} cores this process may use)"
        )
    if d.shard_mb < 1:
        raise ConfigError("data.shard_mb", d.shard_mb, "must be >= 1 (MB of input per work unit and shard)")
    if d.cache_dir is not None and not str(d.cache_dir).strip():
        raise ConfigError(
            "data.cache_dir", repr(d.cache_dir), "a folder, or null (LAUNCHER_DATA_CACHE, else ~/.cache/launcher/data)"
        )
    k8s = cfg.cluster.k8s
    if cfg.cluster.scheduler == Scheduler.k8s and not cache_root(d).is_relative_to(Path(k8s.mount_path)):
        raise ConfigError(
            "data.cache_dir",
            str(cache_root(d)),
            f"the pods read the prepared data: put the cache on "
            f"the shared volume, e.g. data.cache_dir={k8s.mount_path}/data-cache",
        )


def validate_hf_text(cfg: Config, against_model: bool = True) -> None:
    """Files, field, tokenizer and vocabulary (against the model's embedding unless
    `against_model` is False: `make data` prepares for any model), checked before
    anything is written."""
    offline()
    validate_prepare_fields(cfg)
    d = cfg.data
    files = resolve_files(d)
    fmt = file_format(d, files)
    for f in files:
        fields = fields_of(f, fmt)
        if fields is not None and d.text_field not in fields:
            where = (
                "plain text files have only `text`" if fmt == TextFormat.text else f"its fields: {', '.join(fields)}"
            )
            raise ConfigError("data.text_field", d.text_field, f"not a field of {f}; {where}")
    tok = load_tokenizer(d.tokenizer)
    if against_model:
        check_vocabulary(cfg, tok)


def validate_chat(cfg: Config, against_model: bool = True) -> None:
    """data=chat: files (JSON lines or parquet) with a conversation column, a tokenizer
    folder with a chat template that renders (or data.chat_template), the vocabulary."""
    offline()
    validate_prepare_fields(cfg)
    d = cfg.data
    files = resolve_files(d)
    fmt = file_format(d, files)
    if fmt == TextFormat.text:
        raise ConfigError("data.format", fmt.value, "data=chat reads JSON lines or parquet rows (json, parquet)")
    for f in files:
        fields = fields_of(f, fmt)
        if fields is not None and d.messages_field not in fields and not {"prompt", "completion"} <= set(fields):
            raise ConfigError(
                "data.messages_field",
                d.messages_field,
                f"not a field of {f}, nor are `prompt` and `completion`; its fields: {', '.join(fields)}",
            )
    if d.tokenizer in (None, "???", "byte"):
        raise ConfigError(
            "data.tokenizer",
            d.tokenizer,
            "data=chat needs a tokenizer folder (AutoTokenizer, offline) "
            "whose chat template renders the conversations (or data.chat_template=<file.jinja>)",
        )
    tok = load_tokenizer(d.tokenizer)
    load_template(d, tok.tok)  # type: ignore[union-attr]  # data.tokenizer=byte was refused above
    if against_model:
        check_vocabulary(cfg, tok)


def check_vocabulary(cfg: Config, tok) -> None:
    d, rows = cfg.data, model_vocab_size(cfg)
    if tok.vocab_size > rows:
        raise ConfigError(
            "data.tokenizer",
            d.tokenizer,
            f"its vocabulary of {tok.vocab_size} tokens is larger than the "
            f"model's embedding (model.vocab_size={rows}); use a model with at least {tok.vocab_size} rows",
        )


def prepare_cache(cfg: Config, run_dir: Path) -> str:
    """Prepare the data in the shared cache (or reuse it, prepared already), point
    RUN_DIR/data/<data.name>.json at it, check it holds a sequence of train.seq_len (chat:
    a packed window to train on). Returns the console's line(s)."""
    got = prepare(cfg)
    index, seq_len = got.index, cfg.train.seq_len
    if cfg.data.name == DataKind.chat:
        return point(cfg, run_dir, got, chat_line(cfg, got))
    if index["tokens"] < seq_len + 1:
        raise ConfigError(
            "data.files",
            ",".join(patterns(cfg.data)),
            f"hold {index['tokens']} tokens once tokenized; train.seq_len={seq_len} needs at least {seq_len + 1}",
        )
    # the windows the ranks cut, inside each shard (launcher/data/sources.py)
    windows = int(indexed("data.files", str(got.dir), got.dir / INDEX).windows(seq_len).sum())
    if windows < 1:
        raise ConfigError(
            "train.seq_len",
            seq_len,
            f"longer than every shard of the prepared data ({got.dir}: "
            f"{len(index['shards'])} shards, the longest {max(s['tokens'] for s in index['shards'])} tokens; "
            "windows are cut inside a shard): a shorter train.seq_len, or the files in fewer, larger ones",
        )
    return point(
        cfg,
        run_dir,
        got,
        f"data: {index['documents']:,} documents, {index['tokens']:,} tokens, {windows:,} sequences of {seq_len}",
    )


def chat_line(cfg: Config, got) -> str:
    """data=chat's console line(s): samples, tokens, counted ones, the packing at train.seq_len
    and the samples longer than a window (cut to one)."""
    index, seq_len, d = got.index, cfg.train.seq_len, cfg.data
    if not index["documents"]:
        raise ConfigError("data.files", ",".join(patterns(d)), "hold no conversation")
    packed = Packed(got.dir, seq_len + 1)
    if packed.windows - held_out_windows(packed.windows, d.val_fraction) < 1:
        raise ConfigError(
            "data.val_fraction", d.val_fraction, f"leaves none of the {packed.windows} packed windows to train on"
        )
    line = (
        f"data: {packed.samples:,} conversations, {index['tokens']:,} tokens ({index['counted']:,} counted in the "
        f"loss: data.train_on={d.train_on.value}), {packed.windows:,} windows of {seq_len} packed "
        f"{packed.efficiency():.1%} full"
    )
    if packed.truncated:
        line += (
            f"\ndata: {packed.truncated:,} of {packed.samples:,} conversations are longer than train.seq_len + 1 = "
            f"{seq_len + 1} tokens: each is cut to one window (its tail is not trained)"
        )
    return line


def point(cfg: Config, run_dir: Path, got, line: str) -> str:
    """RUN_DIR/data/<data.name>.json names the prepared directory; `line` and where it came
    from for the console."""
    index = got.index
    root = run_dir / "data"
    root.mkdir(parents=True, exist_ok=True)
    pointer = root / f"{cfg.data.name.value}.json"
    try:
        previous = json.loads(pointer.read_text()).get("dir") if pointer.is_file() else None
    except ValueError:
        previous = None
    write_json_atomic(
        pointer,
        {
            "dir": str(got.dir),
            "dtype": index["dtype"],
            "tokens": index["tokens"],
            "documents": index["documents"],
            "shards": len(index["shards"]),
        },
    )
    changed = (
        " (inputs changed since the last launch)"
        if previous and Path(previous).is_absolute() and previous != str(got.dir)
        else ""
    )
    head, _, rest = line.partition("\n")
    return f"{head}; {describe(got)}{changed}" + (f"\n{rest}" if rest else "")


# ----------------------------------------------------------------------------- rank side
def token_file_config(cfg: Config, run_dir: Path) -> DataConfig:
    """The rank's view: data.path = the prepared directory RUN_DIR/data/<data.name>.json names
    (the folder holding index.json), data.dtype = its index's."""
    pointer = run_dir / "data" / f"{cfg.data.name.value}.json"
    if not pointer.is_file():
        raise FileNotFoundError(f"{pointer}: no prepared data; launch through `launcher train`, which prepares it")
    folder = Path(json.loads(pointer.read_text())["dir"])
    if not (folder / INDEX).is_file():
        raise FileNotFoundError(
            f"{folder / INDEX}: the prepared data {pointer} names is gone (a cleaned cache?); "
            "launch through `launcher train` again, which prepares it"
        )
    index = json.loads((folder / INDEX).read_text())
    return dataclasses.replace(cfg.data, path=str(folder), dtype=TokenDtype(index["dtype"]))

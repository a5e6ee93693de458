"""data=chat's work unit (launcher/data/units.py plans them, cache.py runs them): its rows
read with their line (JSON lines) or row (parquet) numbers, each rendered into tokens
and a loss mask (launcher/data/chat.py), written as three files renamed into place:

    shard_<k>.bin      the tokens, flat, of the index's dtype (as data=hf_text's shards)
    shard_<k>.mask     one uint8 per token: bit 0 counts in the loss, bit 1 starts a sample
    shard_<k>.len      one uint32 per sample: its tokens (the samples in order)

then the unit's record. A bad row stops the preparation in one line naming the file and
its 1-based line (or row) number.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from launcher.config import ConfigError, TextFormat, TrainOn
from launcher.data import units
from launcher.data.chat import COUNTS, RowError, Template, conversation, render
from launcher.data.inputs import load_tokenizer

MASK, LENGTHS = ".mask", ".len"


def side_names(shard: str) -> dict[str, str]:
    """The mask and lengths files beside a shard, as its index entry names them."""
    stem = shard[: -len(".bin")]
    return {"mask": stem + MASK, "lengths": stem + LENGTHS}


def line_number(path: Path, offset: int) -> int:
    """The 1-based line of the byte at `offset` (counted only when a row is refused)."""
    with open(path, "rb") as f:
        return f.read(offset).count(b"\n") + 1


def rows(piece: dict, fmt: TextFormat, columns: list[str]):
    """(rows, input bytes) of one piece, chunk by chunk; a row is (where, value): `where`
    the byte offset of its line (JSON) or its 1-based row number (parquet, as -n)."""
    path = Path(piece["path"])
    if fmt == TextFormat.parquet:
        import pyarrow.parquet as pq  # local: optional (pyarrow)

        f = pq.ParquetFile(path)
        before = [sum(f.metadata.row_group(g).num_rows for g in range(k)) for k in piece["row_groups"]]
        present = [c for c in columns if c in f.schema_arrow.names]
        for group, size, first in zip(piece["row_groups"], piece["sizes"], before):
            for batch in f.iter_batches(
                batch_size=units.BATCH_ROWS, row_groups=[group], columns=present, use_threads=False
            ):
                values = batch.to_pylist()
                yield [(-(first + k + 1), v) for k, v in enumerate(values)], 0
                first += len(values)
            yield [], size
        return
    for offset, chunk in units._chunks(path, piece["start"], piece["end"]):
        out, at = [], offset
        for line in chunk.split(b"\n"):
            where, at = at, at + len(line) + 1
            if line.strip():
                try:
                    out.append((where, json.loads(line.decode("utf-8"))))
                except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
                    raise ConfigError("data.files", str(path), f"line {line_number(path, where)}: not JSON ({err})")
        yield out, len(chunk)


def where_text(path: Path, where: int) -> str:
    """`line N` of a JSON-lines file, `row N` of a parquet file (1-based)."""
    return f"row {-where}" if where < 0 else f"line {line_number(path, where)}"


def tokenize_chat_unit(job: dict, report) -> dict:
    """Unit job["unit"] into its shard, mask and lengths (each written whole or not at all),
    then its record unit_<k>.json; returns the record."""
    unit, folder, fmt = job["unit"], Path(job["dir"]), TextFormat(job["format"])
    tok = load_tokenizer(job["tokenizer"]).tok  # type: ignore[union-attr]  # data=chat: data.tokenizer=byte is refused
    dtype = np.dtype(job["dtype"])
    template, train_on, field = (
        Template(job["template"], tuple(job["template_key"])),
        TrainOn(job["train_on"]),
        job["field"],
    )
    names = {"file": units.shard_name(unit), **side_names(units.shard_name(unit))}
    tmp = {k: folder / units.tmp_name(n) for k, n in names.items()}
    samples, tokens, counted, lengths = 0, 0, 0, []
    with open(tmp["file"], "wb") as out, open(tmp["mask"], "wb") as masks:
        for piece in job["pieces"]:
            path = Path(piece["path"])
            for batch, nbytes in rows(piece, fmt, [field, "prompt", "completion"]):
                made = 0
                for where, row in batch:
                    try:
                        ids, mask = render(tok, template, *conversation(row, field, train_on), train_on)
                    except RowError as err:  # the row's fault, or the template's (err.key)
                        spot = where_text(path, where)
                        if err.key:
                            raise ConfigError(*err.key, f"{path} {spot}: {err}")
                        raise ConfigError("data.files", str(path), f"{spot}: {err}")
                    if ids.max() >= np.iinfo(dtype).max + 1:
                        raise ConfigError("data.tokenizer", job["tokenizer"], f"token {ids.max()} does not fit {dtype}")
                    out.write(ids.astype(dtype).tobytes())
                    masks.write(mask.tobytes())
                    lengths.append(len(ids))
                    made, counted = made + len(ids), counted + int(np.count_nonzero(mask & COUNTS))
                samples, tokens = samples + len(batch), tokens + made
                report(unit, nbytes, len(batch), made)
        with open(tmp["lengths"], "wb") as sizes:
            sizes.write(np.asarray(lengths, dtype=np.uint32).tobytes())
            for f in (out, masks, sizes):
                f.flush()
                os.fsync(f.fileno())
    if tokens:
        for k in ("mask", "lengths", "file"):  # the shard last: a shard with its files beside it
            os.replace(tmp[k], folder / names[k])
    else:  # a unit without a row writes no shard
        for path in tmp.values():
            path.unlink()
    record = {
        "unit": unit,
        "file": names["file"] if tokens else None,
        "tokens": tokens,
        "documents": samples,
        "bytes": job["bytes"],
        "counted": counted,
        **({k: names[k] for k in ("mask", "lengths")} if tokens else {}),
    }
    units.write_json_atomic(folder / units.record_name(unit), record)
    return record

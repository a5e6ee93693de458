"""Work units of a preparation (launcher/data/cache.py) and the worker that tokenizes one.

A unit is a list of pieces, each a byte range of a JSON-lines or text file that ends just
after a newline (or at the end of the file), or a run of a parquet file's row groups; a
unit holds about `unit_bytes` of input: small files share one, a large file is cut into
several. Unit k's documents come before unit k+1's, the files' order and each file's own.

A worker tokenizes its unit in chunks (CHUNK_BYTES of input, so its memory stays bounded
whatever the unit's size), writes the tokens to a temporary file, fsyncs it and renames
it to shard_<k>.bin, then writes unit_<k>.json the same way: a shard with a record beside
it is whole. Progress goes to the parent through a queue, batch by batch.
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import re
import signal
import socket
from pathlib import Path

import numpy as np

from launcher.config import ConfigError, TextFormat
from launcher.data.inputs import load_tokenizer

CHUNK_BYTES = 4 << 20
"""Input read, parsed and tokenized at once by a worker (JSON lines, text)."""
BATCH_DOCS = 1024
"""Documents tokenized at once; progress is reported after each batch."""
BATCH_ROWS = 4096
"""Parquet rows read at once."""

SURROGATE = re.compile("[\ud800-\udfff]")
"""A surrogate code point alone: JSON's "\\ud800" decodes to one, which no UTF-8 holds."""

_queue = None


def shard_name(unit: int) -> str:
    return f"shard_{unit:06d}.bin"


def record_name(unit: int) -> str:
    return f"unit_{unit:06d}.json"


def tmp_name(name: str) -> str:
    """A temporary name of this process on this host (nodes sharing a cache folder)."""
    return f".{name}.{socket.gethostname()}.{os.getpid()}.tmp"


class Unreadable(ConfigError):
    """A file the OS could not read (an NFS hiccup, a file moved away): nothing about the
    key's content is wrong, so the units done are kept for the next launch."""


def write_json_atomic(path: Path, value) -> None:
    """`value` as JSON in `path`: written to a temporary name, fsynced, renamed."""
    tmp = path.with_name(tmp_name(path.name))
    with open(tmp, "w") as f:
        f.write(json.dumps(value, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- planning
def plan_units(files: list[Path], fmt: TextFormat, unit_bytes: int) -> list[list[dict]]:
    """The work units over `files`, in order (see the module's doc). A piece is {"file": i,
    "start", "end"} (bytes) or {"file": i, "row_groups": [...], "sizes": [...]} (parquet)."""
    units: list[list[dict]] = []
    current: list[dict] = []
    filled = 0

    def close() -> None:
        nonlocal current, filled
        if current:
            units.append(current)
        current, filled = [], 0

    for i, path in enumerate(files):
        if fmt == TextFormat.parquet:
            for group, size in row_group_sizes(path):
                if current and filled + size > unit_bytes:
                    close()
                last = current[-1] if current else None
                if last is None or last["file"] != i:
                    last = {"file": i, "row_groups": [], "sizes": []}
                    current.append(last)
                last["row_groups"].append(group)
                last["sizes"].append(size)
                filled += size
            continue
        size, pos = path.stat().st_size, 0
        with open(path, "rb") as f:
            while pos < size:
                if filled >= unit_bytes:
                    close()
                room = unit_bytes - filled
                end = size if pos + room >= size else line_end(f, pos + room - 1, size)
                current.append({"file": i, "start": pos, "end": end})
                filled += end - pos
                pos = end
    close()
    return units


def piece_bytes(piece: dict) -> int:
    return sum(piece["sizes"]) if "sizes" in piece else piece["end"] - piece["start"]


def row_group_sizes(path: Path) -> list[tuple[int, int]]:
    import pyarrow.parquet as pq  # local: optional (pyarrow)

    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as err:  # pyarrow's own error types for a file that is not parquet
        raise ConfigError("data.files", str(path), f"not a parquet file ({str(err).splitlines()[0]})")
    return [
        (g, max(1, sum(meta.row_group(g).column(c).total_compressed_size for c in range(meta.num_columns))))
        for g in range(meta.num_row_groups)
    ]


def line_end(f, at: int, size: int) -> int:
    """The position just after the first newline at or after `at` (or the file's end)."""
    f.seek(at)
    pos = at
    while pos < size:
        block = f.read(1 << 16)
        if not block:
            break
        nl = block.find(b"\n")
        if nl >= 0:
            return pos + nl + 1
        pos += len(block)
    return size


# ----------------------------------------------------------------------------- reading
def documents(piece: dict, fmt: TextFormat, field: str):
    """(texts, input bytes they came from) of one piece, chunk by chunk; a text may be None
    (a row without the field). A file that cannot be read is refused, named."""
    path = Path(piece["path"])
    try:
        if fmt == TextFormat.parquet:
            yield from _parquet(path, piece["row_groups"], piece["sizes"], field)
        else:
            for offset, chunk in _chunks(path, piece["start"], piece["end"]):
                yield (
                    (
                        _json_texts(chunk, field, path, offset)
                        if fmt == TextFormat.json
                        else _text_lines(chunk, path, offset)
                    ),
                    len(chunk),
                )
    except ConfigError:
        raise
    except OSError as err:  # the file, not its content: the units done are kept
        raise Unreadable(
            "data.files",
            str(path),
            f"could not be read ({str(err).strip()[:200]}); the units prepared so far are kept: launch again to go on",
        )
    except Exception as err:  # pyarrow's errors on a malformed file
        raise ConfigError("data.files", str(path), f"cannot be read ({str(err).strip().splitlines()[0][:200]})")


def _chunks(path: Path, start: int, end: int):
    with open(path, "rb") as f:
        f.seek(start)
        pos = start
        while pos < end:
            chunk = f.read(min(CHUNK_BYTES, end - pos))
            if not chunk:
                raise OSError(f"ends at byte {pos}, before {end}: changed while it was read")
            if pos + len(chunk) < end and not chunk.endswith(b"\n"):
                chunk += f.readline()  # the piece ends after a newline: this never reads past it
            yield pos, chunk
            pos += len(chunk)


def _json_texts(chunk: bytes, field: str, path: Path, offset: int) -> list:
    import pyarrow as pa  # local: optional (pyarrow)
    import pyarrow.json as pj  # local: optional (pyarrow)

    if not chunk.strip():
        return []
    try:  # pyarrow reads only the field, as text: 3x faster than json.loads on short documents
        table = pj.read_json(
            io.BytesIO(chunk),
            read_options=pj.ReadOptions(use_threads=False, block_size=len(chunk) + 1),
            parse_options=pj.ParseOptions(
                explicit_schema=pa.schema([(field, pa.string())]), unexpected_field_behavior="ignore"
            ),
        )
        return table.column(field).to_pylist()
    except (pa.ArrowInvalid, UnicodeDecodeError):  # json line by line: what is wrong, and where
        return _json_texts_slowly(chunk, field, path, offset)


def _json_texts_slowly(chunk: bytes, field: str, path: Path, offset: int) -> list:
    texts, at = [], offset
    for line in chunk.split(b"\n"):
        where, at = at, at + len(line) + 1
        if not line.strip():
            continue
        try:
            row = json.loads(line.decode("utf-8"))
        except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
            raise ConfigError("data.files", str(path), f"cannot be read (the line at byte {where}: {err})")
        if not isinstance(row, dict):
            raise ConfigError(
                "data.files",
                str(path),
                f"the line at byte {where} is not a JSON object (JSON lines expected: one object per line)",
            )
        text = row.get(field)
        if text is not None and not isinstance(text, str):
            raise ConfigError("data.text_field", field, f"{path} holds a {type(text).__name__} in it, not text")
        texts.append(text)
    return texts


def _text_lines(chunk: bytes, path: Path, offset: int) -> list[str]:
    """One document per line; \\r\\n and \\r end a line too (universal newlines)."""
    try:
        text = chunk.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError("data.files", str(path), f"cannot be read (not UTF-8 text at byte {offset + err.start})")
    return text.replace("\r\n", "\n").replace("\r", "\n").split("\n")


def _parquet(path: Path, groups: list[int], sizes: list[int], field: str):
    import pyarrow as pa  # local: optional (pyarrow)
    import pyarrow.parquet as pq  # local: optional (pyarrow)

    f = pq.ParquetFile(path)
    for group, size in zip(groups, sizes):
        for batch in f.iter_batches(batch_size=BATCH_ROWS, row_groups=[group], columns=[field], use_threads=False):
            column = batch.column(0)
            if not (
                pa.types.is_string(column.type)
                or pa.types.is_large_string(column.type)
                or pa.types.is_null(column.type)
                or str(column.type) == "string_view"
            ):
                value = next((v for v in column.to_pylist() if v is not None), None)
                if value is not None:
                    raise ConfigError(
                        "data.text_field", field, f"{path} holds a {type(value).__name__} in it, not text"
                    )
            yield column.to_pylist(), 0
        yield [], size


# ----------------------------------------------------------------------------- the worker
def init_worker(queue, parent: int, inherited_fd: int | None) -> None:
    """A pool process: progress to `queue`; Ctrl-C is the parent's to handle; it dies with
    the parent (Linux); it lets go of the parent's lock (a forked copy of its descriptor
    would hold the lock after the parent died); the tokenizer runs on this one core."""
    global _queue
    _queue = queue
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: a worker notices its parent is gone when it reports
        pass
    if os.getppid() != parent:
        os._exit(1)
    if inherited_fd is not None:
        try:
            os.close(inherited_fd)
        except OSError:
            pass


def run_unit(job: dict, work=None) -> dict:
    """One unit, in a pool process, by `work` (tokenize_unit, or data=chat's
    chat_units.tokenize_chat_unit): its record, or {"error": [key, value, allowed]} (a
    ConfigError does not survive pickling)."""
    try:
        return (work or tokenize_unit)(job, _report)
    except ConfigError as err:
        return {"error": [err.key, str(err.value), err.allowed], "resumable": isinstance(err, Unreadable)}


def _report(unit: int, nbytes: int, docs: int, tokens: int) -> None:
    if _queue is not None:
        _queue.put((unit, nbytes, docs, tokens))


def tokenize_unit(job: dict, report) -> dict:
    """Tokenize unit job["unit"] into shard_<k>.bin (written whole or not at all), then its
    record unit_<k>.json; returns the record."""
    unit, folder, fmt = job["unit"], Path(job["dir"]), TextFormat(job["format"])
    tok, dtype = load_tokenizer(job["tokenizer"]), np.dtype(job["dtype"])
    name = shard_name(unit)
    tmp = folder / tmp_name(name)
    docs = tokens = 0
    with open(tmp, "wb") as out:
        for piece in job["pieces"]:
            for texts, nbytes in documents(piece, fmt, job["field"]):
                texts = [t for t in texts if t]  # empty documents add nothing
                if not texts:
                    report(unit, nbytes, 0, 0)
                    continue
                batches = range(0, len(texts), BATCH_DOCS)
                for n, first in enumerate(batches):
                    batch = texts[first : first + BATCH_DOCS]
                    try:
                        ids = tok.pack(batch, dtype)
                    except Exception:  # a lone surrogate (JSON's "\ud800") is not UTF-8: U+FFFD for it, again
                        try:
                            ids = tok.pack([SURROGATE.sub("\ufffd", t) for t in batch], dtype)
                        except Exception as err:  # text the tokenizer cannot take
                            raise ConfigError("data.files", piece["path"], f"cannot be tokenized ({str(err)[:200]})")
                    out.write(ids.tobytes())
                    docs, tokens = docs + len(batch), tokens + len(ids)
                    share = nbytes // len(batches) + (nbytes % len(batches) if n == len(batches) - 1 else 0)
                    report(unit, share, len(batch), len(ids))
        out.flush()
        os.fsync(out.fileno())
    if tokens:
        os.replace(tmp, folder / name)
    else:  # a unit without a document writes no shard
        tmp.unlink()
    record = {
        "unit": unit,
        "file": name if tokens else None,
        "tokens": tokens,
        "documents": docs,
        "bytes": job["bytes"],
    }
    write_json_atomic(folder / record_name(unit), record)
    return record

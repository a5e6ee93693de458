"""Pretrained weights read shard-wise from a save_pretrained folder: a rank holds only what it keeps.

    folder/model.safetensors                     one file, or several
    folder/model-00001-of-00003.safetensors ...  listed by tensor in
    folder/model.safetensors.index.json          {"weight_map": {tensor: file}}

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON ({name:
{"dtype", "shape", "data_offsets": [begin, end]}}, offsets counted from the byte after the
header), then the raw row-major data. `index` reads the headers only and checks them
against the file sizes, so a truncated or garbled file is named before any rank copies a
byte; `read` and `read_flat` copy one region of one tensor (a tensor-parallel slice, a
ZeRO-3 flat range) into the rank's own storage.

Plain positioned reads (os.preadv into one reused buffer), never mmap, never pickle: a
mapped file's pages count against the rank's resident memory as they are touched, and
pickle runs code from the file. What a rank holds beyond the tensors it keeps is one chunk
(max_chunk_bytes, at least one row), whatever the checkpoint's size. The format is parsed
here, not by safetensors or transformers, so the ranks need neither.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

if sys.byteorder != "little":  # safetensors data is little-endian; it is viewed as-is, never swapped
    raise ImportError("launcher.models.weights reads safetensors data as host order: needs a little-endian host")

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
INDEX = "model.safetensors.index.json"


class WeightsError(Exception):
    """One line naming the tensor and the file: what is wrong. `.tensor` and `.file` say
    which (None where the problem is the whole file or folder)."""

    def __init__(self, message: str, tensor: str | None = None, file: Path | str | None = None):
        super().__init__(message)
        self.tensor = tensor
        self.file = Path(file) if file is not None else None


def _error(tensor: str | None, file: Path, what: str) -> WeightsError:
    return WeightsError(f"{tensor} in {file}: {what}" if tensor else f"{file}: {what}", tensor, file)


@dataclass(frozen=True)
class Entry:
    """Where one tensor's data lies: bytes [start, end) of `file`, absolute offsets."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def _header(path: Path) -> dict[str, Entry]:
    """The entries of one file, checked against its size (reads the header only)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _error(None, path, f"{size} bytes: too short for a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > min(100 << 20, size - 8):  # 100 MiB, the safetensors library's own limit
                raise _error(None, path, f"truncated or garbled: header length {n}, file size {size} bytes")
            raw = json.loads(f.read(n).decode("utf-8"))
    except OSError as e:
        raise _error(None, path, f"unreadable: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _error(None, path, f"garbled header: not JSON ({e})") from None
    if not isinstance(raw, dict):
        raise _error(None, path, "garbled header: not a JSON object")
    base, entries = 8 + n, {}
    for name, info in raw.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            ok = (
                isinstance(dtype, str)
                and isinstance(shape, list)
                and type(begin) is type(end) is int
                and 0 <= begin <= end
                and all(type(d) is int and d >= 0 for d in shape)
            )
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise _error(name, path, f"garbled header entry {json.dumps(info)[:200]}")
        if dtype not in DTYPES:
            raise _error(name, path, f"dtype {dtype} not handled (handled: {', '.join(DTYPES)})")
        want = math.prod(shape) * DTYPES[dtype].itemsize
        if end - begin != want:
            raise _error(
                name,
                path,
                f"data_offsets [{begin}, {end}] hold {end - begin} bytes where {dtype} {tuple(shape)} needs {want}",
            )
        entries[name] = Entry(name, path, DTYPES[dtype], tuple(shape), base + begin, base + end)
    for entry in sorted(entries.values(), key=lambda x: x.start):
        if entry.end > size:
            raise _error(entry.name, path, f"truncated: the file has {size} bytes, the data ends at byte {entry.end}")
    return entries


def _weight_map(path: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
        if all(isinstance(v, str) for v in weight_map.values()):
            return weight_map
    except OSError as e:
        raise _error(None, path, f"unreadable: {e.strerror or e}") from None
    except (ValueError, KeyError, TypeError, AttributeError):
        pass
    raise _error(None, path, "garbled: not JSON with a weight_map of {tensor: file name}")


def index(folder: str | Path) -> dict[str, Entry]:
    """Every tensor of the folder's weights, by name: of the files model.safetensors.index.json's
    weight_map names (each must exist and hold the tensors listed for it) or, without one,
    of every *.safetensors file. Raises WeightsError for an unreadable or garbled header,
    a dtype not handled, data_offsets whose size is not dtype x shape, a file shorter than
    its data (naming the first tensor past the end), a name in two files."""
    folder = Path(folder)
    if not folder.is_dir():
        raise _error(None, folder, "no such folder (a save_pretrained folder with *.safetensors)")
    listing = folder / INDEX
    weight_map = _weight_map(listing) if listing.exists() else None
    if weight_map is not None:
        for tensor, name in sorted(weight_map.items()):
            if Path(name).name != name or not name.endswith(".safetensors") or not (folder / name).is_file():
                raise _error(tensor, listing, f"its file {name!r} is not a .safetensors file in {folder}")
        files = sorted({folder / name for name in weight_map.values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise _error(None, folder, "no *.safetensors weights in this folder")
    found: dict[str, Entry] = {}
    for path in files:
        for name, e in _header(path).items():
            if name in found:
                raise _error(name, path, f"also in {found[name].file}: which copy is meant?")
            found[name] = e
    for tensor, name in sorted((weight_map or {}).items()):
        if tensor not in found or found[tensor].file.name != name:
            raise _error(tensor, listing, f"weight_map puts it in {name}, which does not hold it")
    return found


def check(entries: dict[str, Entry], expected: dict[str, tuple[int, ...]], ignore: Iterable[str] = ()) -> None:
    """Raise WeightsError for the first problem in name order: a tensor the model expects
    that the files lack, one the files hold that the model has no parameter for (unless
    in `ignore`: buffers a checkpoint may carry), or a shape that differs. All of these
    are checked before a rank allocates or reads anything, so a wrong folder fails the
    same way on every rank, at once, with the name to look for."""
    ignore = set(ignore)
    folder = next(iter(entries.values())).file.parent if entries else None
    for name in sorted(set(entries) | set(expected)):
        e = entries.get(name)
        if e is None:
            raise WeightsError(
                f"{name}: missing from {folder or 'the folder'} (the folder's *.safetensors "
                f"hold {len(entries)} tensors)",
                name,
                folder,
            )
        if name not in expected:
            if name not in ignore:
                raise _error(name, e.file, "not a parameter of the model")
        elif e.shape != tuple(expected[name]):
            raise _error(name, e.file, f"shape {e.shape} where the model has {tuple(expected[name])}")


def _pread_into(fd: int, view: memoryview, offset: int, entry: Entry) -> None:
    """Fill `view` from the file at `offset`; the file ending first is a WeightsError."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise _error(
                entry.name,
                entry.file,
                f"short read: the file ends at byte {offset + got}, the data "
                f"runs to {offset + len(view)} (truncated after indexing?)",
            )
        got += n


def _copy(
    entry: Entry,
    first: int,
    count: int,
    inner: tuple[int, ...],
    cut: tuple[slice, ...],
    out: torch.Tensor,
    max_chunk_bytes: int,
) -> torch.Tensor:
    """Rows [first, first + count) of the tensor seen as rows of shape `inner`, each cut by
    `cut`, into `out`: straight into out's storage when its bytes are the file's, else
    through one buffer of at most max_chunk_bytes (at least one row), reused for each chunk."""
    unit = math.prod(inner)
    unit_bytes, offset = unit * entry.dtype.itemsize, entry.start + first * unit * entry.dtype.itemsize
    try:
        fd = os.open(entry.file, os.O_RDONLY)
    except OSError as e:
        raise _error(entry.name, entry.file, f"unreadable: {e.strerror or e}") from None
    try:
        if (
            all(c == slice(None) for c in cut)
            and out.device.type == "cpu"
            and out.dtype == entry.dtype
            and out.is_contiguous()
        ):
            _pread_into(fd, memoryview(out.detach().reshape(-1).view(torch.uint8).numpy()), offset, entry)
            return out
        per = min(count, max(1, max_chunk_bytes // unit_bytes))
        buf = bytearray(per * unit_bytes)
        for pos in range(0, count, per):
            n = min(per, count - pos)
            _pread_into(fd, memoryview(buf)[: n * unit_bytes], offset + pos * unit_bytes, entry)
            rows = torch.frombuffer(buf, dtype=entry.dtype, count=n * unit).view(n, *inner)
            with torch.no_grad():  # out may be a parameter
                out[pos : pos + n].copy_(rows[(slice(None),) + cut])
    finally:
        os.close(fd)
    return out


def read(
    entry: Entry,
    box: Sequence[tuple[int, int]] | None = None,
    out: torch.Tensor | None = None,
    max_chunk_bytes: int = 16 << 20,
) -> torch.Tensor:
    """The region `box` (one (start, stop) per dimension; None: the whole tensor),
    converted to out's dtype and copied into `out` (the box's shape, any device, may be a
    non-contiguous view), or a new CPU tensor of the file's dtype when out is None.
    Reads whole rows of dimension 0, in chunks of at most max_chunk_bytes (at least one
    row), and slices the other dimensions in memory: memory beyond `out` stays one chunk."""
    shape = entry.shape
    box = [(0, s) for s in shape] if box is None else [(int(a), int(b)) for a, b in box]
    if len(box) != len(shape) or any(not 0 <= a <= b <= s for (a, b), s in zip(box, shape)):
        raise ValueError(f"{entry.name}: box {box} does not fit its shape {shape}")
    size = tuple(b - a for a, b in box)
    if out is None:
        out = torch.empty(size, dtype=entry.dtype)
    elif tuple(out.shape) != size:
        raise ValueError(f"{entry.name}: out has shape {tuple(out.shape)}, the box {box} is {size}")
    if out.numel():  # an empty box reads nothing
        first, count = (box[0][0], size[0]) if shape else (0, 1)  # 0-dim: one row of one element
        cut = tuple(slice(None) if (a, b) == (0, s) else slice(a, b) for (a, b), s in zip(box[1:], shape[1:]))
        _copy(entry, first, count, shape[1:], cut, out if shape else out.view(1), max_chunk_bytes)
    return out


def read_flat(
    entry: Entry, start: int, stop: int, out: torch.Tensor | None = None, max_chunk_bytes: int = 16 << 20
) -> torch.Tensor:
    """Elements [start, stop) of the tensor in row-major order, as a 1-D tensor (into
    `out`, 1-D, when given), in chunks as `read` (DeepSpeed ZeRO-3 partitions each
    parameter by such flat ranges)."""
    if not 0 <= start <= stop <= math.prod(entry.shape):
        raise ValueError(f"{entry.name}: flat range [{start}, {stop}) outside its shape {entry.shape}")
    if out is None:
        out = torch.empty(stop - start, dtype=entry.dtype)
    elif tuple(out.shape) != (stop - start,):
        raise ValueError(f"{entry.name}: out has shape {tuple(out.shape)}, the range is ({stop - start},)")
    return _copy(entry, start, stop - start, (), (), out, max_chunk_bytes) if stop > start else out

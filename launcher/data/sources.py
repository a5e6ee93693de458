"""Token sources, read by both sides (no torch): which files a data path names, how many
tokens each holds, the order an epoch visits windows in, and how a weighted mixture blends
its sources, every one a pure function of the configuration, the seed and the global
sample index.

A data path (data.path, or a source's path in data.sources) is one of:
- a flat token file (nanoGPT's train.bin: uint16 or uint32, data.dtype);
- a prepared directory (`make data`: index.json and its shards, dtype from the index);
- a directory of flat files (every *.bin in it, sorted by name), or a glob of them.
Its files are one stream: windows of seq_len + 1 tokens are cut inside each file (none
spans two), numbered file after file. Opening 10,000 shards reads the index (or stats the
files) and nothing else; the ranks map files when a window needs them (read.py).

An epoch visits the windows in a seeded pseudo-random order: a bijection of [0, N)
(a Feistel network with cycle walking), so the order costs no memory at any N (a
permutation array of 10^8 windows would be 800 MB in every rank and loader worker).

A mixture (data.sources: name, path, weight) assigns global sample i to a source by
position i mod BLEND_PERIOD of one period of the error-minimising interleave (Megatron's
blending order): within the period every prefix holds each source within one sample of
its weight's share; the period's counts are rounded, so over many periods a share drifts
from its weight by under one sample per period (1/65536 of it). Source s's own k-th sample is window k of its own epoch order (epoch k // N_s), so
a source that runs out starts a fresh order; the loop logs it.
"""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from launcher.config import ConfigError, DataConfig, TokenDtype
from launcher.data.shards import NotItsOwn, bad_name

INDEX = "index.json"
BLEND_PERIOD = 1 << 16
NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class Source:
    name: str
    path: str
    weight: float
    val_path: str | None = None


@dataclass(frozen=True)
class Stream:
    """The files of one data path, in order, and their token counts."""

    files: tuple[str, ...]
    tokens: tuple[int, ...]
    dtype: TokenDtype

    def windows(self, seq_len: int) -> np.ndarray:
        """Windows of seq_len + 1 tokens per file (the last token of one window is the
        first of the next: targets shift by one)."""
        return np.maximum(0, (np.asarray(self.tokens, dtype=np.int64) - 1) // seq_len)


def stream(key: str, path: str, dtype: TokenDtype) -> Stream:
    """The files `path` names (see the module's doc); refused in one line when none."""
    p = Path(os.path.expanduser(path))
    index = p / INDEX if p.is_dir() else p if p.name == INDEX else None
    if index is not None and index.is_file():
        return indexed(key, path, index)
    if p.is_file():
        found = [str(p)]
    elif p.is_dir():
        found = sorted(str(f) for f in p.glob("*.bin") if f.is_file())
    else:  # a glob: its token files (*.bin) only, never a prepared folder's shards one by one
        found = sorted(f for f in glob.glob(os.path.expanduser(path)) if Path(f).is_file() and f.endswith(".bin"))
        prepared = next((f for f in found if (Path(f).parent / INDEX).is_file()), None)
        if prepared:
            raise ConfigError(
                key,
                path,
                f"matches {prepared}, a shard of the prepared folder {Path(prepared).parent}: "
                "name that folder (its index.json holds the shards' order and dtype)",
            )
    if not found:
        raise ConfigError(
            key,
            path,
            "no such file; allowed: a token file, a folder of *.bin shards or one "
            "`make data` prepared (index.json), or a glob",
        )
    sizes = [os.path.getsize(f) for f in found]
    cut = next((f"{f} has {size:,} bytes" for f, size in zip(found, sizes) if size % dtype.width), None)
    if cut:  # a copy that stopped half-way: its last token is half a token
        raise ConfigError(
            key,
            path,
            f"{cut}, not a whole number of {dtype.value} tokens ({dtype.width} bytes "
            "each): a copy cut short, or another data.dtype? Copy it again whole",
        )
    return Stream(tuple(found), tuple(size // dtype.width for size in sizes), dtype)


def indexed(key: str, path: str, index: Path) -> Stream:
    """A prepared folder's stream, from its index.json; refused in one line when the index
    is not one, or a shard is missing or shorter than the index says."""
    try:
        meta = json.loads(index.read_text())
        if meta.get("format") != "launcher-tokens":
            raise ValueError("not a prepared token index (make data writes one)")
        dtype = TokenDtype(meta["dtype"])
        shards = [(index.parent / s["file"], int(s["tokens"])) for s in meta["shards"]]
        # data=chat: a byte of mask per token and a uint32 length per sample beside each shard
        sides = [
            (index.parent / s[k], int(s["tokens"] if k == "mask" else 4 * s["documents"]), 1)
            for s in meta["shards"]
            for k in ("mask", "lengths")
            if k in s
        ]
    except KeyError as err:
        raise ConfigError(key, path, f"{index} has no {err} (not an index make data wrote)")
    except (ValueError, TypeError, AttributeError) as err:  # not JSON, a wrong type, an unknown dtype
        raise ConfigError(key, path, f"{index}: {err}")

    wrong = next((w for w in (bad_name(index.parent, s) for s in meta["shards"]) if w), None)
    if wrong:  # /etc/passwd, ../other/shard_000000.bin: never read
        raise NotItsOwn(key, path, f"{index} {wrong}")
    for f, tokens, width in [(f, t, dtype.width) for f, t in shards] + sides:
        size = f.stat().st_size if f.is_file() else None
        if size is None or size // width < tokens or size % width:
            raise ConfigError(
                key,
                path,
                f"{index} names {f.name} with {tokens} {'tokens' if width > 1 else 'bytes'}; "
                + ("it is missing" if size is None else f"it holds {size // width}"),
            )
    return Stream(tuple(str(f) for f, _ in shards), tuple(t for _, t in shards), dtype)


def windows_of(key: str, path: str, dtype: TokenDtype, seq_len: int) -> int:
    """A data path's windows; refused when it holds fewer tokens than one window."""
    s = stream(key, path, dtype)
    n = int(s.windows(seq_len).sum())
    if n < 1:
        raise ConfigError(
            key,
            path,
            f"holds {sum(s.tokens)} tokens in {len(s.files)} file(s), none with a window of "
            f"train.seq_len + 1 = {seq_len + 1}",
        )
    return n


# ----------------------------------------------------------------------------- mixtures
def sources(d: DataConfig) -> list[Source]:
    """data.sources as a list (one source `main` for a plain data.path). Accepts the
    Megatron form "30 path_a 70 path_b" (names: the files' stems) or a list of
    {name, path, weight[, val_path]}; weights are normalised."""
    raw = d.sources
    if raw is None:
        return [Source("main", d.path, 1.0, d.val_path)] if d.path is not None else []
    if isinstance(raw, str):
        words = raw.split()
        if len(words) < 2 or len(words) % 2:
            raise ConfigError("data.sources", raw, "the Megatron form is pairs of weight and path: '30 a.bin 70 b/'")
        raw = [{"weight": w, "path": p} for w, p in zip(words[::2], words[1::2])]
    if not isinstance(raw, (list, tuple)) or not raw:
        raise ConfigError("data.sources", raw, "a list of {name, path, weight} or '30 path_a 70 path_b'")
    out = []
    for item in raw:
        item = dict(item) if hasattr(item, "keys") else None
        if item is None or not {"path", "weight"} <= set(item) or set(item) - {"name", "path", "weight", "val_path"}:
            raise ConfigError("data.sources", raw, "each source is {name, path, weight} (val_path optional)")
        name = str(item.get("name") or default_name(str(item["path"])))
        try:
            weight = float(item["weight"])
        except (TypeError, ValueError):
            weight = float("nan")
        if not NAME.fullmatch(name):
            raise ConfigError(
                "data.sources", name, "a source's name: letters, digits, '_', '.', '-' (it names metrics)"
            )
        if not weight > 0 or weight == float("inf"):
            raise ConfigError("data.sources", item["weight"], f"source {name}'s weight must be a number > 0")
        out.append(Source(name, str(item["path"]), weight, item.get("val_path")))
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ConfigError(
            "data.sources", dup, "two sources share this name; name them: {name: ..., path: ..., weight: ...}"
        )
    total = sum(s.weight for s in out)
    small = next((s for s in out if s.weight / total < 1 / BLEND_PERIOD), None)
    if small is not None:
        raise ConfigError(
            "data.sources",
            small.weight,
            f"source {small.name}'s share {small.weight / total:.2g} is below "
            f"the blend's resolution (1/{BLEND_PERIOD}): it would never be drawn",
        )
    return [Source(s.name, s.path, s.weight / total, s.val_path) for s in out]


def default_name(path: str) -> str:
    """A source's name from its path: the file's or folder's name, without `.bin`."""
    name = Path(path.rstrip("/")).name
    return name[:-4] if name.endswith(".bin") else name


def blend(weights: list[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One period of the interleave: (source of each position, its rank among that
    source's positions, each source's count in the period). Position p goes to the
    source furthest behind its share of p + 1 samples (ties: the lower index)."""
    w = np.asarray(weights, dtype=np.float64)
    if len(w) == 1:
        return np.zeros(BLEND_PERIOD, dtype=np.int32), np.arange(BLEND_PERIOD), np.asarray([BLEND_PERIOD])
    which = np.empty(BLEND_PERIOD, dtype=np.int32)
    rank = np.empty(BLEND_PERIOD, dtype=np.int64)
    count = np.zeros(len(w), dtype=np.int64)
    for p in range(BLEND_PERIOD):
        s = int(np.argmax(w * (p + 1) - count))
        which[p], rank[p] = s, count[s]
        count[s] += 1
    return which, rank, count


def consumed(which: np.ndarray, count: np.ndarray, n: int) -> np.ndarray:
    """Samples each source gave to the first n global samples."""
    whole, part = divmod(n, BLEND_PERIOD)
    return whole * count + np.bincount(which[:part], minlength=len(count))


# ----------------------------------------------------------------------------- epoch order
def _mix(x: int) -> int:
    """splitmix64's finaliser: a 64-bit integer hash."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def epoch_key(*parts: int) -> int:
    key = 0
    for part in parts:
        key = _mix(key ^ (part & 0xFFFFFFFFFFFFFFFF))
    return key


def permuted(i: int, n: int, key: int) -> int:
    """Position i of a pseudo-random permutation of [0, n) chosen by `key`: four Feistel
    rounds over the smallest even number of bits covering n, walking the cycle until the
    value falls inside [0, n) (under 4 walks on average)."""
    if n <= 1:
        return 0
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    x = i
    while True:
        left, right = x >> half, x & mask
        for r in range(4):
            left, right = right, left ^ (_mix(key ^ (r << 56) ^ right) & mask)
        x = (left << half) | right
        if x < n:
            return x


def _mix_array(x: np.ndarray) -> np.ndarray:
    """_mix of each uint64 (numpy's uint64 arithmetic wraps as the masks above do)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def permuted_many(i: np.ndarray, n: int, key: int) -> np.ndarray:
    """`permuted` of every position in `i` at once (the same values)."""
    if n <= 1:
        return np.zeros(len(i), dtype=np.int64)
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    shift, mask = np.uint64(half), np.uint64((1 << half) - 1)
    out = np.asarray(i, dtype=np.uint64).copy()
    todo = np.arange(len(out))
    while len(todo):
        left, right = out[todo] >> shift, out[todo] & mask
        for r in range(4):
            left, right = right, left ^ (_mix_array(np.uint64(key ^ (r << 56)) ^ right) & mask)
        out[todo] = (left << shift) | right
        todo = todo[out[todo] >= n]
    return out.astype(np.int64)

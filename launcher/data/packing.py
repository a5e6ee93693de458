"""Windows of whole samples (data=chat), read by both sides (numpy, no torch).

A prepared chat folder (launcher/data/chat_units.py) holds, per shard, the tokens, a mask
byte per token and each sample's length. Its samples are packed into windows of
train.seq_len + 1 tokens when a run reads it (seq_len is not part of the cache key): in
stored order, each shard on its own, a window takes the next samples while they fit whole
(greedy next-fit: deterministic, one binary search per window). A sample longer than a
window has a window of its own, truncated to it: its tail is never trained (the launch side
counts them in one line). The rest of a window is padding: the end-of-document token,
counted in no loss. Window w is the same on every rank, at any world size and on resume;
an epoch visits the windows in the order of launcher/data/sources.py.

A window as the ranks get it is (3, seq_len + 1) int64: the tokens, the loss mask (1 where
the token counts as a target) and the positions: restarting at 0 at each sample (and at
the padding) with data.document_masking, else 0..seq_len.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from launcher.data.chat import COUNTS, START

INDEX = "index.json"


def pack(lengths: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(first token, real tokens) of each window of `size` tokens over samples of `lengths`
    tokens, stored one after the other: whole samples in order while they fit."""
    ends = np.cumsum(np.asarray(lengths, dtype=np.int64))
    starts = ends - lengths
    firsts, i, n = [], 0, len(ends)
    while i < n:
        firsts.append(i)
        i = max(i + 1, int(np.searchsorted(ends, starts[i] + size, side="right")))
    first = np.asarray(firsts, dtype=np.int64)
    last = np.append(first[1:], n) - 1
    return starts[first], np.minimum(ends[last] - starts[first], size)


def restart_positions(starts: np.ndarray) -> np.ndarray:
    """Positions counting from 0 at each True of `starts` (starts[0] is one)."""
    idx = np.arange(len(starts), dtype=np.int64)
    return idx - np.maximum.accumulate(np.where(starts, idx, 0))


class Packed:
    """A prepared chat folder's windows of `size` tokens (launcher/data/cache.py's index)."""

    def __init__(self, folder: str | Path, size: int):
        folder = Path(folder)
        index = json.loads((folder / INDEX).read_text())
        self.size, self.pad, self.dtype = size, int(index["eos_id"]), np.dtype(index["dtype"])
        self.files = [str(folder / s["file"]) for s in index["shards"]]
        self.masks = [str(folder / s["mask"]) for s in index["shards"]]
        shard, start, real = [], [], []
        self.samples = self.truncated = 0
        for k, s in enumerate(index["shards"]):
            lengths = np.fromfile(folder / s["lengths"], dtype=np.uint32).astype(np.int64)
            first, tokens = pack(lengths, size)
            shard.append(np.full(len(first), k, dtype=np.int32))
            start.append(first)
            real.append(tokens.astype(np.int32))
            self.samples += len(lengths)
            self.truncated += int(np.count_nonzero(lengths > size))
        self.shard, self.start, self.real = (
            np.concatenate(a) if a else np.empty(0, np.int64) for a in (shard, start, real)
        )
        self.windows = len(self.start)

    def efficiency(self) -> float:
        """Real tokens over window tokens, over every window."""
        return float(self.real.sum()) / max(1, self.windows * self.size)

    def window(self, w: int, document_masking: bool) -> np.ndarray:
        """Window w as (3, size) int64: tokens, loss mask, positions."""
        s, start, real = int(self.shard[w]), int(self.start[w]), int(self.real[w])
        out = np.zeros((3, self.size), dtype=np.int64)
        out[0] = self.pad
        out[0, :real] = np.fromfile(self.files[s], dtype=self.dtype, count=real, offset=start * self.dtype.itemsize)
        mask = np.fromfile(self.masks[s], dtype=np.uint8, count=real, offset=start)
        out[1, :real] = mask & COUNTS
        if not document_masking:
            out[2] = np.arange(self.size)
            return out
        starts = np.zeros(self.size, dtype=bool)
        starts[:real] = (mask & START) != 0
        starts[0] = True
        if real < self.size:
            starts[real] = True  # the padding: a segment of its own
        out[2] = restart_positions(starts)
        return out

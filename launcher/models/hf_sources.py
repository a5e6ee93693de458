"""Where a project parameter lies in a Hugging Face folder's tensors (launcher/models/hf_adapter.py),
read a box or a flat range at a time (launcher/models/weights.py does the reading).

    Whole       one tensor as it is (embeddings, norms, the router, a fused down_proj)
    Half        the first or second half of dim 1 of one tensor (a fused gate_up_proj's w1 or w3)
    Stack       tensors stacked on a new dim 0 (one per expert: Mixtral's experts.{e}.w1.weight)
    RotaryRows  one tensor whose rows are permuted per head, halves -> adjacent pairs (q, k: their
                weights, biases, and per-head norms, whose one "head" is the whole tensor)

A box of the project tensor is read from the boxes it covers in the folder's tensors, straight
into the rank's storage; RotaryRows goes through one attention head's rows at a time. A flat
range (ZeRO-3) is cut into at most 2 x ndim - 1 boxes whose row-major order is contiguous
(`flat_boxes`), each read as a box.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from launcher.models import weights

Box = tuple[tuple[int, int], ...]


class Source:
    entries: list[weights.Entry]
    shape: tuple[int, ...]

    def read(self, box: Box, out: torch.Tensor) -> None:
        raise NotImplementedError

    def read_flat(self, start: int, stop: int, out: torch.Tensor) -> None:
        """Elements [start, stop) in row-major order into the 1-D `out`."""
        for box, at in flat_boxes(self.shape, start, stop):
            size = tuple(b - a for a, b in box)
            self.read(box, out[at - start : at - start + math.prod(size)].view(size))


class Whole(Source):
    def __init__(self, entry: weights.Entry):
        self.entries, self.shape = [entry], tuple(entry.shape)

    def read(self, box: Box, out: torch.Tensor) -> None:
        weights.read(self.entries[0], box, out=out)


class Half(Source):
    def __init__(self, entry: weights.Entry, second: bool):
        e, n = entry.shape[0], entry.shape[1] // 2 if len(entry.shape) == 3 else -1
        self.entries, self.offset = [entry], n * second
        self.shape = (e, n, entry.shape[2]) if n > 0 and entry.shape[1] % 2 == 0 else (e, -1)  # -1: no such shape

    def read(self, box: Box, out: torch.Tensor) -> None:
        (e0, e1), (a, b), cols = box
        weights.read(self.entries[0], ((e0, e1), (a + self.offset, b + self.offset), cols), out=out)


class Stack(Source):
    def __init__(self, entries: list[weights.Entry]):
        self.entries = entries
        shapes = {tuple(e.shape) for e in entries}
        self.shape = (len(entries), *entries[0].shape) if len(shapes) == 1 else (len(entries), -1)

    def read(self, box: Box, out: torch.Tensor) -> None:
        (e0, e1), rest = box[0], box[1:]
        for e in range(e0, e1):
            weights.read(self.entries[e], rest, out=out[e - e0])


class RotaryRows(Source):
    """Project row h * head_dim + 2j + s is the folder's row h * head_dim + s * head_dim/2 + j."""

    def __init__(self, entry: weights.Entry, head_dim: int):
        self.entries, self.shape, self.head_dim = [entry], tuple(entry.shape), head_dim

    def read(self, box: Box, out: torch.Tensor) -> None:
        (a, b), *cols = box  # cols: none for a bias or a per-head norm
        hd = self.head_dim
        for h in range(a // hd, -(-b // hd)):
            rows = weights.read(self.entries[0], ((h * hd, (h + 1) * hd), *cols))  # one head, the file's dtype
            pairs = rows.view(2, hd // 2, *rows.shape[1:]).transpose(0, 1).reshape(rows.shape)
            lo, hi = max(a, h * hd), min(b, (h + 1) * hd)
            with torch.no_grad():
                out[lo - a : hi - a].copy_(pairs[lo - h * hd : hi - h * hd])


def flat_boxes(shape: tuple[int, ...], start: int, stop: int, at: int = 0) -> Iterator[tuple[Box, int]]:
    """(box, its first element's flat index) covering elements [start, stop) of a tensor of
    `shape` in row-major order, each box contiguous in that order, in order."""
    if start >= stop:
        return
    if not shape:
        yield (), at
        return
    inner = math.prod(shape[1:])
    r0, o0 = divmod(start, inner)
    r1, o1 = divmod(stop, inner)
    full = tuple((0, s) for s in shape[1:])
    if r0 == r1:
        for sub, pos in flat_boxes(shape[1:], o0, o1, at + r0 * inner):
            yield ((r0, r0 + 1), *sub), pos
        return
    if o0:
        for sub, pos in flat_boxes(shape[1:], o0, inner, at + r0 * inner):
            yield ((r0, r0 + 1), *sub), pos
        r0 += 1
    if r1 > r0:
        yield ((r0, r1), *full), at + r0 * inner
    if o1:
        for sub, pos in flat_boxes(shape[1:], 0, o1, at + r1 * inner):
            yield ((r1, r1 + 1), *sub), pos

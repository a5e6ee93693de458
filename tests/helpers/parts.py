"""Shard-wise reads checked against the whole: the folder readers of the Hugging Face adapters
(launcher/models/hf_adapter.py) for every layout a rank can ask for."""

from __future__ import annotations

import math

import torch


def check_parts_read_alone(read, whole: dict[str, torch.Tensor], tries: int, seed: int = 0) -> None:
    """Random boxes (FSDP and expert-parallel shards) and flat ranges (ZeRO-3 partitions) of
    every parameter in `whole`, read alone by `read(name, out, shape, box, flat)`, equal that
    part of the parameter read whole."""
    g = torch.Generator().manual_seed(seed)
    for name, full in whole.items():
        shape = tuple(full.shape)
        for _ in range(tries):
            box = []
            for n in shape:
                a, b = sorted(torch.randint(0, n + 1, (2,), generator=g).tolist())
                box.append((a, max(b, a + 1) if a < n else b))
            out = torch.full([b - a for a, b in box], float("nan"))
            read(name, out, shape, tuple(box), None)
            assert torch.equal(out, full[tuple(slice(a, b) for a, b in box)].detach()), (name, box)
            start, stop = sorted(torch.randint(0, math.prod(shape) + 1, (2,), generator=g).tolist())
            flat = torch.full((stop - start,), float("nan"))
            read(name, flat, shape, None, (start, stop))
            assert torch.equal(flat, full.detach().reshape(-1)[start:stop]), (name, start, stop)

"""Bring a model built on the meta device to life, on each rank only the part it holds.

    build on meta (no storage) -> the recipe parallelizes it (TP plan, fully_shard,
    pipeline split, zero.Init partitions) -> materialize(): to_empty on the device, each
    rank allocating only its part -> fill that part: seeded init, or the owned slices of
    model.pretrained's *.safetensors (launcher/models/weights.py)

**Why the initial weights do not depend on the layout.** A parameter's values are a
function of (train.seed, the parameter's full-model name, the global position of each
element), never of which rank holds what. The parameter is cut, in flat row-major order,
into blocks of whole rows of dimension 0 (at most BLOCK = 2^18 elements, at least one row); block
k is drawn from its own generator, seeded with sha256(seed, name, k). A rank that owns a
box of the tensor (an FSDP or tensor-parallel shard: a DTensor's local part, at the global
offset DTensor reports; ddp's plain expert shards under parallel.ep name theirs in their
module's `held_boxes`) or a flat range (a ZeRO-3 partition) draws only the blocks that
overlap it and keeps its part, so the same element gets the same value at world size 1,
2 or 512, under ddp, fsdp, tp, pp, tp_fsdp and zero3 alike; the memory it needs beyond its
own part is one block. (Generators run on the compute device: CUDA draws other numbers
than the CPU, so the weights are the same for a given seed and device type.) A tied head
is named as the embedding, so both copies a pipeline keeps start equal.

What each parameter is drawn from (an `InitSpec`) is the model's own rule, written down by
name: gpt.py's GPT-2 style init (normal(0, init_std), residual projections scaled by
1/sqrt(2 n_layers), norms ones), or for model=hf the rule transformers' `_init_weights`
applies (normal(0, initializer_range) for linear and embedding weights, the padding row
zero, biases zero, norms ones).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import resource
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from launcher import offline
from launcher.models import weights

BLOCK = 1 << 18
"""Elements drawn per generator call (1 MiB in fp32): the memory init needs beyond the
rank's own part, and the granularity of the layout-independent numbering."""


@dataclass(frozen=True)
class InitSpec:
    kind: str = "normal"
    """normal, ones or zeros."""
    std: float = 0.02
    zero_row: int | None = None
    """An embedding's padding row, set to zero after drawing."""


# ----------------------------------------------------------------------------- where a rank's part lies
def is_dtensor(t: torch.Tensor) -> bool:
    """No tensor is a DTensor unless torch.distributed.tensor was imported (by FSDP, TP,
    DCP): the launch side and a ddp or ZeRO rank never import it (0.7 s of start-up each)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def local_part(
    p: torch.Tensor,
) -> tuple[torch.Tensor, tuple[int, ...], tuple[tuple[int, int], ...] | None, tuple[int, int] | None]:
    """(the tensor this rank writes, the full shape, its box in the full tensor or None,
    its flat range in the full tensor or None). A DTensor (FSDP, TP, both) owns a box; a
    ZeRO-3 parameter owns a flat range of its padded partition; anything else is whole."""
    if is_dtensor(p):
        shape = tuple(p.shape)
        box = dtensor_box(shape, p.device_mesh, p.placements)
        local = p._local_tensor
        assert tuple(local.shape) == tuple(b - a for a, b in box), (shape, p.placements, tuple(local.shape), box)
        return local, shape, box, None
    if hasattr(p, "ds_tensor"):  # DeepSpeed ZeRO-3: rank r holds flat [r * part, (r + 1) * part) of the padded param
        part = p.ds_tensor
        size = part.ds_numel
        start = min(p.ds_numel, size * _ds_rank(p))
        stop = min(p.ds_numel, start + size)
        return part.view(-1)[: stop - start], tuple(p.ds_shape), None, (start, stop)
    return p.data, tuple(p.shape), tuple((0, n) for n in p.shape), None


def dtensor_box(shape: tuple[int, ...], mesh, placements) -> tuple[tuple[int, int], ...]:
    """This rank's [start, stop) per dimension of a DTensor, in the order the shardings were
    applied: plain Shard placements first (tensor parallel), then _StridedShard ones (FSDP
    over a tensor-parallel shard: it chunks the TP-local rows again). Each split is
    torch.chunk's (ceil-sized pieces, the last ones shorter or empty), as DTensor and FSDP2
    cut. (DTensor's compute_local_shape_and_global_offset disagrees with FSDP2 on uneven
    2-D shards: a last data-parallel rank gets a shifted box.)"""
    coord = mesh.get_coordinate()
    box = [[0, n] for n in shape]
    plain = [(k, pl) for k, pl in enumerate(placements) if pl.is_shard() and type(pl).__name__ != "_StridedShard"]
    strided = [(k, pl) for k, pl in enumerate(placements) if type(pl).__name__ == "_StridedShard"]
    for k, pl in plain + strided:
        d = pl.dim
        start, length = box[d][0], box[d][1] - box[d][0]
        n = mesh.size(k)
        chunk = -(-length // n) if length else 0
        lo = min(length, coord[k] * chunk)
        box[d] = [start + lo, start + min(length, lo + chunk)]
    return tuple((a, b) for a, b in box)


def _ds_rank(p) -> int:
    return dist.get_rank(group=p.ds_process_group)


# ----------------------------------------------------------------------------- drawing
def _seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.sha256(f"{seed}\0{name}\0{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _rows_per_block(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows of dimension 0 per block, elements per row)."""
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, BLOCK // max(row, 1)), row


def _draw(spec: InitSpec, seed: int, name: str, block: int, numel: int, device: torch.device) -> torch.Tensor:
    if spec.kind == "ones":
        return torch.ones(numel, device=device)
    if spec.kind == "zeros":
        return torch.zeros(numel, device=device)
    g = torch.Generator(device=device)
    g.manual_seed(_seed(seed, name, block))
    return torch.randn(numel, generator=g, device=device).mul_(spec.std)


def fill(
    dst: torch.Tensor, shape: tuple[int, ...], box, flat, spec: InitSpec, seed: int, name: str, device: torch.device
) -> None:
    """Write the values of `name`'s region (a box, or a flat range) into `dst`."""
    rows_per, row = _rows_per_block(shape)
    n_rows = shape[0] if shape else 1
    if flat is not None:
        start, stop = flat
        first_row, end_row = start // row, -(-stop // row)
    else:
        first_row, end_row = box[0] if shape else (0, 1)
    if end_row <= first_row or dst.numel() == 0:
        return
    out = dst.view(-1) if flat is not None else dst
    for k in range(first_row // rows_per, -(-end_row // rows_per)):
        r0, r1 = k * rows_per, min(n_rows, (k + 1) * rows_per)
        values = _draw(spec, seed, name, k, (r1 - r0) * row, device)
        if spec.zero_row is not None and r0 <= spec.zero_row < r1:
            values.view(r1 - r0, row)[spec.zero_row - r0].zero_()
        if flat is not None:  # elements [a, b) of this block that fall in the range
            a, b = max(start, r0 * row), min(stop, r1 * row)
            out[a - start : b - start].copy_(values[a - r0 * row : b - r0 * row])
            continue
        a, b = max(first_row, r0), min(end_row, r1)  # rows of this block inside the box
        piece = values.view(r1 - r0, *shape[1:])[a - r0 : b - r0] if shape else values.view(())
        for d, (lo, hi) in enumerate(box[1:], start=1):
            piece = piece.narrow(d, lo, hi - lo)
        target = out.narrow(0, a - first_row, b - a) if shape else out
        target.copy_(piece)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype | None):
    """torch's default floating dtype set to `dtype` (None: left as it is) inside the block."""
    saved = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


@contextlib.contextmanager
def skip_torch_init():
    """Modules built in this block allocate their parameters without drawing them
    (nn.Linear's kaiming init, nn.Embedding's normal; launcher.models.hf.build adds
    transformers' no_init_weights): on a real device that work would be thrown away, since
    materialize() draws every value."""
    saved = {cls: cls.reset_parameters for cls in (nn.Linear, nn.Embedding)}
    _skipping.append(True)
    try:
        for cls in saved:
            cls.reset_parameters = _no_init
        yield
    finally:
        _skipping.pop()
        for cls, f in saved.items():
            cls.reset_parameters = f


_skipping: list[bool] = []


def init_skipped() -> bool:
    """Inside skip_torch_init: a model's own __init__ should not draw its weights either."""
    return bool(_skipping)


def _no_init(self) -> None:
    return None


def recorded_specs(model: nn.Module, hf: nn.Module) -> dict[str, InitSpec]:
    """Parameter name (in `model`, which holds the transformers model `hf`'s children under
    their own names) -> InitSpec, as transformers' `_init_weights` initialises this model
    type: its normal_, ones_, zeros_ and constant_ calls (transformers.initialization) are
    recorded on the meta-device structure, an embedding's zeroed padding row included. A
    parameter it leaves alone gets normal(0, initializer_range) when it is a matrix, ones
    when it is a vector named weight, zeros otherwise."""
    offline()
    from transformers import initialization as hf_init  # local: optional (transformers, after offline())

    names: dict[int, list[str]] = {}  # a tied weight has two names
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    params = {id(p): p for p in model.parameters()}
    specs: dict[str, InitSpec] = {}

    def record(kind: str):
        def call(tensor, *args, **kwargs):
            if id(tensor) in names:
                std = kwargs.get("std", args[1] if len(args) > 1 else 1.0) if kind == "normal" else 0.0
                for name in names[id(tensor)]:
                    specs[name] = InitSpec(kind, float(std))
            elif tensor._base is not None and id(tensor._base) in params and kind == "zeros":  # padding row
                base = tensor._base
                row = tensor.storage_offset() // base.stride(0)
                for name in names[id(base)]:
                    if name in specs:
                        specs[name] = InitSpec(specs[name].kind, specs[name].std, zero_row=row)
            return tensor

        return call

    def constant(tensor, val):
        return record("ones" if val == 1 else "zeros")(tensor) if val in (0, 1) else tensor

    patched = {"normal_": record("normal"), "ones_": record("ones"), "zeros_": record("zeros"), "constant_": constant}
    saved = {k: getattr(hf_init, k) for k in patched}
    try:
        for k, f in patched.items():
            setattr(hf_init, k, f)
        for module in hf.modules():
            if list(module.parameters(recurse=False)):
                hf._init_weights(module)
    finally:
        for k, f in saved.items():
            setattr(hf_init, k, f)
    std = getattr(hf.config, "initializer_range", None) or 0.02
    for name, p in model.named_parameters(remove_duplicate=False):
        if name not in specs:
            specs[name] = (
                InitSpec(std=std) if p.dim() >= 2 else InitSpec("ones" if name.endswith("weight") else "zeros")
            )
    return specs


# ----------------------------------------------------------------------------- the model
def canonical(name: str, tied: tuple[str, str] | None) -> str:
    """A tied head's weight under the embedding's name (one set of values for both)."""
    return tied[1] if tied is not None and name == tied[0] else name


def materialize(
    model: nn.Module,
    device: torch.device,
    specs: dict[str, InitSpec],
    seed: int,
    tied: tuple[str, str] | None,
    init_buffers,
    pretrained: str | Path | None = None,
    storage: torch.device | None = None,
    fresh=frozenset(),
) -> nn.Module:
    """Storage on `storage` (default `device`) for what this rank holds (`to_empty`:
    untouched memory), its buffers computed (`init_buffers(model, device)`), its
    parameters drawn on `device` from `specs` or read from `pretrained`. No collective:
    every rank fills its own part (`pretrained`: a save_pretrained folder under the model's
    own names, or a function read(name, dst, shape, box, flat) for another layout). Names in
    `fresh` (LoRA's adapters) are drawn even when the rest is read from `pretrained`. On the meta device (a rehearsal, launcher/planner/rehearse.py)
    the shapes are all there is: nothing is allocated or drawn."""
    if device.type == "meta":
        return model
    if any(t.is_meta for t in model.parameters()) or any(b.is_meta for b in model.buffers()):
        shared: dict[int, list[str]] = {}  # a tied weight: one Parameter under two names
        for name, p in model.named_parameters(remove_duplicate=False):
            shared.setdefault(id(p), []).append(name)
        model.to_empty(device=storage or device)
        for module in model.modules():  # buffers are computed on the device even when parameters live on the host
            for name, b in list(module._buffers.items()):
                if b is not None and b.device != device:
                    module._buffers[name] = b.to(device)
        for names in shared.values():  # to_empty may give each name its own tensor: tie them again
            keep = model.get_parameter(names[0])
            for name in names[1:]:
                if model.get_parameter(name) is not keep:
                    owner, _, leaf = name.rpartition(".")
                    setattr(model.get_submodule(owner), leaf, keep)
    init_buffers(model, device)
    entries = pretrained if callable(pretrained) else None  # a reader of another layout (models/hf_adapter.py)
    if pretrained is not None and entries is None:
        entries = weights.index(pretrained)
    # Plain tensors that are a box of a larger one (ddp's experts under parallel.ep) say where.
    held = held_boxes(model)
    with torch.no_grad():
        done: set[int] = set()
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in done:
                continue
            done.add(id(p))
            key = canonical(name, tied)
            dst, shape, box, flat = local_part(p) if name not in held else (p.data, *held[name], None)
            if entries is not None and key not in fresh:
                _read(entries, key, dst, shape, box, flat)
            else:
                fill(dst, shape, box, flat, specs[key], seed, key, device)
    global BUILT_PEAK_RSS
    BUILT_PEAK_RSS = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return model


BUILT_PEAK_RSS: int | None = None
"""The process's peak RSS when materialize() last finished: what building this rank's
part of the model cost, before the recipe adds its engine (optimizer set-up, buckets)."""


def held_boxes(model: nn.Module) -> dict[str, tuple[tuple[int, ...], tuple[tuple[int, int], ...]]]:
    """Parameter name -> (full shape, this rank's box) for the plain tensors that are a box
    of a larger one (ddp's experts under parallel.ep: `held_boxes` on their module)."""
    return {
        f"{m_name}.{leaf}" if m_name else leaf: where
        for m_name, m in model.named_modules()
        for leaf, where in getattr(m, "held_boxes", {}).items()
    }


def full_numel(model: nn.Module, trainable: bool = False) -> int:
    """Elements of the whole model's parameters (a shard counts as its full tensor)."""
    boxes = held_boxes(model)
    return sum(
        math.prod(boxes[n][0]) if n in boxes else p.numel()
        for n, p in model.named_parameters()
        if p.requires_grad or not trainable
    )


def _read(entries, key: str, dst: torch.Tensor, shape, box, flat) -> None:
    if callable(entries):
        return entries(key, dst, shape, box, flat)
    entry = entries.get(key)
    if entry is None:
        raise weights.WeightsError(f"{key}: missing from {next(iter(entries.values())).file.parent}", key, None)
    if tuple(entry.shape) != tuple(shape):
        raise weights.WeightsError(
            f"{key} in {entry.file}: shape {tuple(entry.shape)} where the model has {tuple(shape)}", key, entry.file
        )
    if dst.numel() == 0:
        return
    if flat is not None:
        weights.read_flat(entry, flat[0], flat[1], out=dst)
    else:
        weights.read(entry, box, out=dst)

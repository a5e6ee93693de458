"""One device mesh from the parallel degrees, the order in which parallelisms are
applied, and the gradient arithmetic they need.

The mesh has five named dimensions, outermost first: (pp, dp_replicate, dp_shard, cp, tp).
Degrees of 1 are kept as dimensions of size 1, so every recipe slices the same mesh by
name and a rank's coordinates are `degrees.Degrees.coords(rank)` everywhere (rank/entry.py
picks the data slice from them without building a mesh).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

import engines
from launcher import config as C
from launcher.device import autocast_dtype
from launcher.parallel import degrees as D
from launcher.parallel.context import attach
from launcher.parallel.cuts import apply_tp, held_blocks
from launcher.parallel.experts import expert_fsdp, expert_placement, shard_as_dtensors, split_mesh
from launcher.rank.engine import local_shard

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def build_mesh(deg: D.Degrees, device: torch.device) -> DeviceMesh:
    """The mesh on the ranks' device type; a rehearsal's model lives on meta, under a fake
    process group that serves the host's (launcher/planner/rehearse.py)."""
    mesh = init_device_mesh(
        "cpu" if device.type == "meta" else device.type,
        (deg.pp, deg.dp_replicate, deg.dp_shard, deg.cp, deg.tp),
        mesh_dim_names=MESH_DIMS,
    )
    # The data slice (rank/entry.py) and the mesh must agree on who is who.
    assert tuple(mesh.get_coordinate()) == deg.coords(dist.get_rank()), (mesh.get_coordinate(), deg)
    return mesh


def data_parallel_mesh(mesh: DeviceMesh, deg: D.Degrees) -> DeviceMesh:
    """What FSDP shards over: 1-D (dp_shard), or 2-D (dp_replicate, dp_shard) for HSDP.
    Under context parallel the cp ranks hold the same parameters and see the same samples'
    other positions: FSDP shards over dp_shard x cp flattened (as torchtitan), so its
    reduce-scatter averages the gradients over both and model states shrink by cp too."""
    shard = dense_shard_mesh(mesh, deg)
    if deg.dp_replicate > 1:
        return mesh["dp_replicate", "dp_shard_cp" if deg.cp > 1 else "dp_shard"]
    return shard


def parallelize(model: torch.nn.Module, mesh: DeviceMesh, deg: D.Degrees, cfg: C.Config) -> None:
    """Apply the parallelisms to `model` in place, in this order (as torchtitan does):

    1. activation checkpointing: rank/entry.py marked the blocks (`model.checkpointed`) before
       any recipe; a marked block is called through torch.utils.checkpoint, outside its
       FSDP and TP hooks, so recomputation re-gathers what it needs.
    2. compile: rank/entry.py called `block.compile()`, which is lazy: the graph is traced at
       the first forward, after 3 and 4, so it sees the sharded (DTensor) block.
    3. tensor parallel, before FSDP: FSDP must shard the DTensors TP made (a second,
       data-parallel dimension on the same mesh: 2-D), not the other way round.
    4. FSDP: each block, then the root (embedding, final norm, head), so one block's
       parameters are gathered at a time. Under parallel.ep the experts are first split over
       the ep ranks, then FSDP-sharded over the rest (launcher/parallel/experts.py).
    """
    if deg.tp > 1:
        apply_tp(model, mesh["tp"], cfg.parallel.sequence_parallel)
    if deg.cp > 1:
        attach(model, mesh["cp"].get_group())
    experts = None
    if deg.ep > 1:  # FSDP's recipes only (ddp splits its experts itself)
        experts = split_mesh(dense_shard_mesh(mesh, deg), deg.ep)
        shard_as_dtensors(model, experts["ep"])
    if engines.spec(cfg.recipe.engine).parallelism.shards:
        apply_fsdp(
            model,
            data_parallel_mesh(mesh, deg),
            cfg,
            mesh.device_type,
            experts["efsdp"] if experts is not None else None,
            deg.dp_shard * deg.cp,
        )


def dense_shard_mesh(mesh: DeviceMesh, deg: D.Degrees) -> DeviceMesh:
    """The 1-D mesh FSDP shards the dense weights over: dp_shard, or dp_shard x cp flattened
    (made once: a second flatten of the same name returns the first)."""
    return mesh["dp_shard", "cp"]._flatten(mesh_dim_name="dp_shard_cp") if deg.cp > 1 else mesh["dp_shard"]


def apply_fsdp(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    cfg: C.Config,
    device_type: str,
    efsdp: DeviceMesh | None = None,
    shards: int = 1,
) -> None:
    """FSDP2: bf16 parameters for compute (fp32 kept sharded for the optimizer), gradients
    reduced in fp32 (a sum over many ranks in bf16 loses bits). The blocks reshard after
    forward as recipe.fsdp.reshard_after_forward says; the root (embedding, final norm,
    head) never does: it is gathered before the first block's forward and its head is the
    first thing backward needs, so its parameters are held gathered through forward and
    backward either way, and resharding would only add an all-gather of the largest
    group each step (torch's own default for the root; torchtitan keeps its final norm and
    head unit gathered the same way)."""
    opts = cfg.recipe.fsdp
    mp = MixedPrecisionPolicy(param_dtype=autocast_dtype(cfg.precision.name.value), reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=device_type == "cuda") if opts.cpu_offload else OffloadPolicy()
    kwargs = dict(mesh=mesh, mp_policy=mp, offload_policy=offload)
    if efsdp is not None:  # parallel.ep: the experts over their own ranks, before their blocks
        expert_fsdp(model, efsdp, shards, dict(mp_policy=mp, offload_policy=offload), opts.reshard_after_forward)

    for layer in held_blocks(model):  # ep = 1: the experts with their block, on dimension 1 where needed
        place = expert_placement(layer, mesh.size()) if efsdp is None else None
        fully_shard(layer, reshard_after_forward=opts.reshard_after_forward, shard_placement_fn=place, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)


# ----------------------------------------------------------------------------- gradients
def allreduce_grads(params, group: dist.ProcessGroup, size: int, bucket_bytes: int = 25 << 20) -> None:
    """Average gradients over data-parallel replicas (recipes that replicate rather than
    shard: tp and pp across their groups), in flat buckets after backward. Unlike DDP it
    does not overlap with backward: simple, and the same result."""
    grads = [local_shard(p.grad) for p in params if p.grad is not None]
    bucket, used = [], 0
    for i, g in enumerate(grads):
        bucket.append(g)
        used += g.numel() * g.element_size()
        if used >= bucket_bytes or i == len(grads) - 1:
            flat = torch._utils._flatten_dense_tensors(bucket)
            dist.all_reduce(flat, group=group)  # gloo has no AVG: sum, then divide
            flat /= size
            for g_, f in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
                g_.copy_(f)
            bucket, used = [], 0


def match_grad_layouts(params) -> None:
    """Bring every DTensor gradient to its parameter's layout. Tensor parallel leaves
    some in another: partial sums (under sequence parallel a norm's weight sees only its
    rank's slice of the sequence) or whole (DTensor computes a vocabulary-parallel
    embedding's gradient replicated; slicing it is free). FSDP does this itself; tensor
    parallel alone must, or the optimizer would work on the wrong layout."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and tuple(g.placements) != tuple(p.placements):
            p.grad = g.redistribute(g.device_mesh, p.placements)


def clip_grad_norm(params, max_norm: float, copies=lambda p: 1, stages: int = 1) -> torch.Tensor:
    """The global gradient norm over shards, replicas and stages, with one all-reduce over
    all ranks; then every gradient is scaled by the same factor (torch's
    clip_grad_norm_ formula). Each rank adds the squares of its local gradient elements
    divided by the number of ranks that hold the same elements: for a DTensor the ranks
    outside its mesh, less the other `stages` of a pipeline (which hold other layers),
    times its replicated mesh dimensions; for a plain tensor `copies(p)`. `copies(p) == 0`
    leaves any tensor out (a tied copy counted on another stage)."""
    world = dist.get_world_size()
    grads, weights = [], []
    for p in params:
        g = p.grad
        if g is None:
            continue
        n = copies(p)
        if n and isinstance(g, DTensor):
            assert not any(pl.is_partial() for pl in g.placements), g.placements
            mesh = g.device_mesh
            n = (
                world
                // (stages * mesh.size())
                * math.prod(mesh.size(i) for i, pl in enumerate(g.placements) if pl.is_replicate())
            )
        grads.append(local_shard(g))
        weights.append(1.0 / n if n else 0.0)
    device = grads[0].device if grads else torch.device("cpu")
    if grads:
        norms = torch.stack(torch._foreach_norm(grads)).double()
        sq = (norms.square() * torch.tensor(weights, dtype=torch.float64, device=device)).sum()
    else:
        sq = torch.zeros((), dtype=torch.float64, device=device)
    dist.all_reduce(sq)
    total = sq.sqrt().float()
    if math.isfinite(max_norm) and grads:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef)
    return total

"""`make rehearse`: ranks of a cluster-sized layout built on this machine, as a real run
builds them, beside the planner's prediction.

For chosen ranks of the layout (the first and the last, the first of each pipeline
stage, each position in a tensor-parallel group), this one process joins a process group
of the layout's whole world size as that rank. The group is torch's "fake" backend
(torch.testing._internal.distributed.fake_pg, torchtitan's COMM_MODE=fake_backend): every
collective returns at once and nothing is sent. The model is built on the meta device and
handed to the recipe's own engine through launcher.rank.entry.build_engine, the call a
rank makes, with the meta device as the rank's device: the engine builds its mesh and
parallelizes the model with the code a run uses (tensor parallel, FSDP2, the pipeline
cut; on a "cpu" mesh, with the unfused optimizer), and materialize keeps only the shapes
(nothing is allocated or drawn on meta). Every parameter then has the shape this rank
would hold. What the engine holds when it is ready is counted (the weights: nothing else
exists before step 1); then a gradient in each parameter's own layout and dtype (what the
engines hold at the optimizer step, counted here: the engines count theirs in a step) and
one step of the engine's own optimizer make Adam's states, which the engine's
state_bytes() counts with the parameters as in a run. The planner's model_states for the
same rank (launcher/planner/footprint.py) is set beside it.

ZeRO-3 (zero3, zero3_offload) is rehearsed too, as far as DeepSpeed runs on a fake group:
its engine is built for real on the host (zero.Init partitions each module as it is
built, so a rank holds its partitions and one module at a time: about 3 GB and 16 s for a
rank of Llama-3-8B on 64, on the host even where there are GPUs), and the parameter partition it holds is set against the
planner's. DeepSpeed cannot take a step there: its first step compares list lengths across
ranks with an all-gather, which a fake group answers with garbage, so the gradient
partitions and Adam's states are reported as built, not as at the step.

Not rehearsed: ddp and ZeRO-1/2 hold the whole model on every rank (the plan's formula
is the model's size, and building it here would need all of it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import engines
from engines.zero.engine import restore_linear
from launcher import config as C
from launcher import models
from launcher.models.init import is_dtensor
from launcher.parallel import degrees as D
from launcher.parallel import ds_config
from launcher.planner import footprint
from launcher.planner import plan as planner
from launcher.planner.plan import GiB, Layout, layout_of, planned_model
from launcher.rank.engine import local_shard, tensor_bytes
from launcher.rank.entry import build_engine

TOLERANCE = 0.02
"""The planner's model states must be within this of a rehearsed rank's (issue's target)."""


@dataclass
class Shard:
    """Parameters with the same name pattern (layer index as *), shapes and placements."""

    name: str
    count: int
    shape: tuple[int, ...]
    local: tuple[int, ...]
    placements: str


@dataclass
class RankReport:
    rank: int
    coords: dict[str, int]
    params: int
    grads: int
    optim: int
    startup: int
    planned: dict[str, int]
    seconds: float
    shards: list[Shard] = field(default_factory=list)
    compared: str = "model_states"
    """What `difference` compares: model_states (all three parts, after a step), or params
    (ZeRO-3: the partition DeepSpeed built; it cannot step on a fake group)."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optim

    @property
    def difference(self) -> float:
        """Planned against rehearsed, relative to rehearsed."""
        held = self.total if self.compared == "model_states" else getattr(self, self.compared)
        return self.planned[self.compared] / held - 1


def rehearsable(cfg: C.Config) -> None:
    """What a rehearsal can set beside the planner, or one line saying why not."""
    if not (on_meta(cfg) or partitioned(cfg)):
        on = [n for n, s in engines.specs().items() if s.builds_on_meta]
        raise C.ConfigError(
            "recipe",
            cfg.recipe.name,
            "not rehearsed: it holds the whole model on every rank (make "
            f"plan gives its figures); rehearsed: {', '.join(on)}, and zero3, zero3_offload",
        )
    if engines.spec(cfg.recipe.engine).parallelism.shards and cfg.parallel.dp_replicate > 1:
        raise C.ConfigError(
            "parallel.dp_replicate",
            cfg.parallel.dp_replicate,
            "not rehearsed with a sharding recipe: "
            "the planner divides by every data-parallel rank, FSDP shards over dp_shard alone (HSDP)",
        )
    planned_model(cfg)  # model=hf: a Llama-layout decoder, or the planner's formulas do not apply


def on_meta(cfg: C.Config) -> bool:
    return engines.spec(cfg.recipe.engine).builds_on_meta


def partitioned(cfg: C.Config) -> bool:
    """ZeRO-3: DeepSpeed partitions the parameters inside zero.Init."""
    spec = engines.spec(cfg.recipe.engine)
    return spec.deepspeed and spec.holds(cfg.recipe).shard == "zero3"


def chosen_ranks(deg: D.Degrees) -> list[int]:
    """The first and the last rank, the first rank of each pipeline stage, each position in
    the first tensor-parallel group, and under parallel.ep the last position of the first
    expert-parallel group (other experts than rank 0's, at the same place among the ranks
    FSDP shards them over; ep neighbours of the data-parallel ranks, tp x apart)."""
    per_stage = deg.world // deg.pp
    return sorted(
        {0, deg.world - 1, (deg.ep - 1) * deg.tp} | {s * per_stage for s in range(deg.pp)} | set(range(deg.tp))
    )


def rehearse_rank(cfg: C.Config, world: int, rank: int, local_rank: int) -> RankReport:
    """Build rank `rank` of `world` under a fake process group (see the module's docstring)."""
    started = time.perf_counter()
    deg = D.degrees(cfg, world)
    layout = layout_of(cfg, deg)
    pp_rank, dp_replicate, dp_shard, cp_rank, tp_rank = deg.coords(rank)
    zero3 = partitioned(cfg)
    # The optimizer's kernel choice changes no state: unfused, which runs on meta and on the host.
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, fused=None))
    engine = params = None
    with as_rank(rank, world, local_rank, zero3), tempfile.TemporaryDirectory(prefix="rehearse-") as scratch:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            if zero3:  # what the launch side writes for DeepSpeed; its engine is built on the host
                (Path(scratch) / ds_config.FILE).write_text(ds_config.text(ds_config.launch_config(cfg, world, False)))
            device = torch.device("cpu" if zero3 else "meta")
            engine = build_engine(
                cfg, models.prepare(models.on_meta(cfg), cfg), device, rank, world, local_rank, Path(scratch)
            )
            startup = engine.state_bytes().total
            params = list(dict.fromkeys(p for p in engine.model.parameters() if p.requires_grad))
            if zero3:
                held = engine.state_bytes()
                grads = held.grads
                shards = group_shards(
                    (name, tuple(p.ds_shape), (p.ds_tensor.numel(),), f"partition {rank} of {world}")
                    for name, p in engine.model.named_parameters()
                )
            else:
                for p in params:  # the gradients the engines hold at the optimizer step: each parameter's layout
                    p.grad = torch.zeros_like(p)
                grads = tensor_bytes(p.grad for p in params)
                engine.optimizer.step()  # type: ignore[attr-defined]  # every recipe's engine holds one
                held = engine.state_bytes()
                shards = group_shards(
                    (name, tuple(p.shape), tuple(local_shard(p).shape), placements(p))
                    for name, p in engine.model.named_parameters()
                )
        finally:
            del engine, params
            if zero3:
                gc.collect()  # a ZeRO-3 rank's partitions (GBs, in reference cycles) before the next rank's
            leave_group(zero3)
    p_, g_, o_, _, _ = footprint.model_states(planned_model(cfg), layout, pp_rank, dp_shard * deg.cp + cp_rank)
    planned = {"params": p_, "grads": g_, "optim": o_, "model_states": p_ + g_ + o_}
    return RankReport(
        rank=rank,
        coords={"pp": pp_rank, "dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp_rank, "tp": tp_rank},
        params=held.params,
        grads=grads,
        optim=held.optim,
        startup=startup,
        planned=planned,
        seconds=time.perf_counter() - started,
        shards=shards,
        compared="params" if zero3 else "model_states",
    )


def leave_group(zero3: bool) -> None:
    """The fake group torn down, whatever happened: DeepSpeed's own teardown where DeepSpeed
    joined it (it drops the groups it keeps, so the next rank's engine finds its own)."""
    if zero3:
        restore_linear()
        import deepspeed.comm as ds_comm  # local: order (DS_ACCELERATOR first: engines.zero.import_deepspeed)

        if ds_comm.comm.cdb is not None and dist.is_initialized():
            ds_comm.destroy_process_group()
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def as_rank(rank: int, world: int, local_rank: int, zero3: bool):
    """DeepSpeed's zero.Init reads the rank from the environment a launcher gives a rank,
    and builds on its accelerator: the host's here (DS_ACCELERATOR=cpu, read once, when
    DeepSpeed is first imported), whatever GPUs this machine has."""
    if not zero3:
        yield
        return
    keys = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank), "DS_ACCELERATOR": "cpu"}
    before = {k: os.environ.get(k) for k in keys}
    os.environ.update(keys)
    try:
        # local: order (DS_ACCELERATOR first: engines.zero.import_deepspeed)
        from deepspeed.accelerator import get_accelerator

        if get_accelerator().device_name() != "cpu":
            raise C.ConfigError(
                "recipe",
                "zero3",
                "a ZeRO-3 rehearsal builds on the host, but DeepSpeed was already "
                f"set to {get_accelerator().device_name()} in this process; run make rehearse alone",
            )
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def placements(p) -> str:
    if not is_dtensor(p):
        return "whole"
    names = p.device_mesh.mesh_dim_names or ()
    return ", ".join(f"{pl}@{names[i] if i < len(names) else i}" for i, pl in enumerate(p.placements))


def group_shards(rows) -> list[Shard]:
    """One line per name pattern (decoder layer index as *) and shapes."""
    out: dict[tuple, Shard] = {}
    for name, shape, local, where in rows:
        key = (re.sub(r"\.\d+\.", ".*.", name), shape, local, where)
        if key in out:
            out[key].count += 1
        else:
            out[key] = Shard(key[0], 1, shape, local, where)
    return list(out.values())


@dataclass
class Rehearsal:
    model: str
    layout: Layout
    world: int
    nnodes: int
    precision: str
    ranks: list[RankReport]
    planned_startup: int
    fits: bool | None
    """The planner's verdict for the configured micro-batch and checkpointing on
    cluster.gpu_memory_gb (None when it is not given)."""
    peak: int | None
    gpu_bytes: int | None

    @property
    def worst(self) -> RankReport:
        return max(self.ranks, key=lambda r: abs(r.difference))

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "layout": {**asdict(self.layout), "label": self.layout.label},
            "world": self.world,
            "nnodes": self.nnodes,
            "precision": self.precision,
            "planned_startup": self.planned_startup,
            "fits": self.fits,
            "peak": self.peak,
            "gpu_bytes": self.gpu_bytes,
            "ranks": [{**asdict(r), "total": r.total, "difference": r.difference} for r in self.ranks],
            "worst": {"rank": self.worst.rank, "difference": self.worst.difference},
        }


def rehearse(
    cfg: C.Config, world: int, gpus_per_node: int, gpu_bytes: int | None, ranks: list[int] | None = None, progress=None
) -> Rehearsal:
    """Rehearse `ranks` (default chosen_ranks) of the configured layout on `world` ranks;
    the plan's verdict for `gpu_bytes` devices (and plan.host_memory_gb of host memory a
    node, when given), as `make plan` gives it."""
    deg = D.degrees(cfg, world)
    layout = layout_of(cfg, deg)
    reports = []
    for rank in ranks if ranks is not None else chosen_ranks(deg):
        reports.append(rehearse_rank(cfg, world, rank, rank % gpus_per_node))
        if progress:
            progress(reports[-1])
    fits = peak = None
    if gpu_bytes is not None:
        host = int(cfg.plan.host_memory_gb * GiB) if cfg.plan.host_memory_gb else None
        hw = planner.Hardware(
            gpu_bytes=gpu_bytes,
            gpus_per_node=gpus_per_node,
            nnodes=world // gpus_per_node,
            tflops=planner.DEFAULT_TFLOPS,
            host_bytes=host,
        )
        shaped = planned_model(cfg)
        row = planner.memory_row(shaped, layout, cfg.train.activation_checkpointing, cfg.train.micro_batch, hw)
        fits, peak = planner.fits(shaped, hw, row), row.peak
    return Rehearsal(
        model=cfg.model.name,
        layout=layout,
        world=world,
        nnodes=world // gpus_per_node,
        precision=cfg.precision.name.value,
        ranks=reports,
        planned_startup=footprint.start_up(planned_model(cfg), layout)[0],
        fits=fits,
        peak=peak,
        gpu_bytes=gpu_bytes,
    )


# ----------------------------------------------------------------------------- report
def gib(b: int) -> str:
    return f"{b / GiB:.2f} GiB" if b >= GiB else f"{b / 2**20:.2f} MiB"


def rank_lines(r: RankReport) -> list[str]:
    where = " ".join(f"{k} {v}" for k, v in r.coords.items())
    if r.compared == "params":
        out = [
            f"rank {r.rank} ({where}), built in {r.seconds:.1f} s: parameter partition {gib(r.params)}, planned "
            f"{gib(r.planned['params'])} ({100 * r.difference:+.2f}%); as built (DeepSpeed takes no step on a fake "
            f"group): gradient partitions {gib(r.grads)}, optimizer {gib(r.optim)}"
        ]
    else:
        out = [
            f"rank {r.rank} ({where}), built in {r.seconds:.1f} s: model states {gib(r.total)} "
            f"(params {gib(r.params)}, grads {gib(r.grads)}, optimizer {gib(r.optim)}); planned "
            f"{gib(r.planned['model_states'])} ({100 * r.difference:+.2f}%); held when the engine is ready "
            f"{gib(r.startup)}"
        ]
    for s in r.shards:
        count = f" x{s.count}" if s.count > 1 else ""
        out.append(f"    {s.name}{count}: {list(s.shape)} -> {list(s.local)}  [{s.placements}]")
    return out


def summary_lines(h: Rehearsal) -> list[str]:
    out = []
    if h.fits is not None:
        verdict = "fits" if h.fits else "does not fit"
        started = max(r.startup for r in h.ranks)
        rehearsed = (
            f"the engines held {gib(started)} when ready (largest rank)"
            if all(r.compared == "model_states" for r in h.ranks)
            else "DeepSpeed's set-up peak is measured on real ranks (tests/e2e/test_startup.py)"
        )
        out.append(
            f"plan: the step {verdict} {h.gpu_bytes / GiB:.0f} GiB devices (peak {gib(h.peak)} a rank); "
            f"start-up planned {gib(h.planned_startup)}, {rehearsed}"
        )
    w = h.worst
    ok = "within" if abs(w.difference) <= TOLERANCE else "outside"
    what = "model states" if w.compared == "model_states" else "parameter partition"
    out.append(
        f"largest difference: {100 * w.difference:+.2f}% on rank {w.rank} of {h.layout.label} "
        f"({h.world} ranks): the planner's {what} {ok} {100 * TOLERANCE:.0f}% of the rehearsal"
    )
    return out

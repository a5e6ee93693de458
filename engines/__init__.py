"""The registry of engines: one module (or package) per engine, engines/<engine>, each
declaring its `SPEC` (an EngineSpec). The spec is the launch side's whole view of an
engine and imports no torch; the code that builds the engine, `build(ctx)` and
`consolidate(cfg, engine_dir)`, lives in the module the spec names (`SPEC.engine`, e.g.
engines/ddp/engine.py), imported only by a rank or by `make export`.

A recipe is a YAML file, conf/recipe/<name>.yaml: its name, the engine it runs
(`recipe.engine`, a module of this package) and that engine's options (zero1/2/3 and
their offload variants are one engine, engines/zero/, with other options). A new recipe
on an existing engine is one YAML; a new engine is one module here plus its YAML.
Validation, the planner, the launch side and the ranks read the specs through `spec()`;
nothing else lists the engines. So `make train` decides, writes the run directory and
starts the ranks without importing torch (about 1.5 s), and a ddp rank never imports
DeepSpeed.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable

from launcher.config import ConfigError


@dataclass(frozen=True)
class Parallelism:
    """What an engine may split beyond replicating the data: data-parallel sharding, tensor
    parallel, pipeline stages, the sequence (the degrees parallel.dp_shard, .tp, .pp, .cp
    it reads)."""

    shards: bool = False
    tp: bool = False
    pp: bool = False
    cp: bool = False
    ep: bool = False
    """parallel.ep > 1: an MoE's experts split over ep of the data-parallel ranks."""
    required: tuple[str, ...] = ()
    """The degrees that must be at least 2 ("tp", "pp"): what the recipe is for (tp=1 under
    recipe=tp is plain data parallel); the others it may use at 1."""


@dataclass(frozen=True)
class Holding:
    """How a recipe holds model states over its data-parallel ranks: the planner's formula
    (launcher/planner/footprint.py). shard: none (replicated), zero1 (optimizer states),
    zero2 (+ gradients), zero3 (+ parameters; ZeRO-3 and FSDP)."""

    shard: str = "none"
    fsdp: bool = False
    offload_optim: bool = False
    offload_params: bool = False
    grad_buckets: bool = False
    """Gradient buckets as big as the model from start-up (DDP's)."""
    grads_freed: bool = False
    """The step's gradients are freed after the optimizer step (zero_grad(set_to_none=True))
    and made again in backward as activations are released, so the two never peak together:
    the step holds the larger of them (FSDP2's engine; DeepSpeed's ZeRO without offload, less
    the buffers it keeps: launcher.planner.footprint.grads_kept; measured on an H200 and with
    torch's MemTracker). Kept gradients (DDP's buckets, a pipeline's accumulation over its
    micro-batches) add to the activations."""


@dataclass(frozen=True)
class EngineSpec:
    """What the rest of the launcher knows of an engine."""

    parallelism: Parallelism = Parallelism()
    """The degrees it may use beyond data parallel; validation refuses the others, the
    planner tries tp in 2, 4, 8 and pp in 2, 4 where it may (and their products where it
    may use both)."""
    engine: str = ""
    """The module that builds it: `build(ctx)` and `consolidate(cfg, engine_dir)` (the
    recipe's own module when empty). Imported by a rank and by export, never by the
    launch side, so it may import torch and the engine's libraries at the top."""
    builds_on_meta: bool = False
    """It shards the meta-device model, then each rank materializes only its part."""
    writes: str = "ddp"
    """Its checkpoint format: ddp (engine/model.pt), dcp (engine/.metadata), deepspeed."""
    reads: tuple[str, ...] = ("ddp",)
    """The formats its engine loads (the launch side's fit check reads this)."""
    holds: Callable = lambda recipe: Holding()
    """recipe config (RecipeConfig) -> Holding: where its model states live."""
    fp16: bool = False
    """It has an fp16 loss scaler (precision=fp16 is refused otherwise)."""
    fp8: bool = False
    """torchao's float8 linear layers run under it without tensor or pipeline parallel
    (precision=fp8 is refused otherwise): its wrapper leaves the swapped nn.Linear
    modules whole (DeepSpeed's partitioning and DTensor's plans do not)."""
    deepspeed: bool = False
    """Runs inside DeepSpeed: the launch side writes and checks RUN_DIR/ds_config.json, and
    DeepSpeed's own launcher (cluster.runner=deepspeed) may start it."""
    preload: Callable | None = None
    """Imports a rank makes before its memory baseline (the library's, not the model's)."""

    @property
    def meshed(self) -> bool:
        """It splits the model (shards, tensor parallel, stages): its ranks form a device mesh
        (parallel.*) whatever the degrees. (ddp builds one only for parallel.cp > 1.)"""
        can = self.parallelism
        return can.shards or can.tp or can.pp


def names() -> list[str]:
    """Every engine: the modules of this package."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def module(name: str):
    """The engine's module (its SPEC), imported on first use; it imports no torch."""
    name = getattr(name, "value", name)
    if name not in names():
        raise ConfigError(
            "recipe.engine",
            name,
            f"no such engine; allowed: {', '.join(names())} "
            "(engines/<engine>: a module or package; a recipe, conf/recipe/<name>.yaml, names one)",
        )
    return importlib.import_module(f"engines.{name}")


def spec(name: str) -> EngineSpec:
    """The spec of engine `name` (a recipe's `recipe.engine`)."""
    return module(name).SPEC


def specs() -> dict[str, EngineSpec]:
    return {name: spec(name) for name in names()}


def engine(name: str):
    """The module with the engine's build and consolidate (SPEC.engine)."""
    builder = spec(name).engine
    return importlib.import_module(builder) if builder else module(name)


def build(ctx):
    """The engine for `ctx.cfg.recipe.engine` (see launcher.rank.engine.Engine)."""
    return engine(ctx.cfg.recipe.engine).build(ctx)


def consolidate(cfg, engine_dir):
    """Full fp32 weights from a checkpoint's engine/ folder, on one process (export)."""
    return engine(cfg.recipe.engine).consolidate(cfg, engine_dir)

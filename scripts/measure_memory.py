#!/usr/bin/env python
"""The planner's matrix against real ranks: for every layout the planner offers at this
world size, every precision, accumulation and activation-checkpointing mode, what the
engine really holds and autograd really saves, beside launcher.planner.plan's prediction.

    torchrun --nproc-per-node 2 scripts/measure_memory.py --out mem.json [--table]

One process group per world size, every cell on it. A layout's config is composed from
conf/ as a user would (`recipe=... parallel.tp=...`), each precision is its own
conf/precision/ file on it, each cell adds
`train.grad_accum` and `train.activation_checkpointing` and is validated as the launch side
does; a refused cell (fp16 without CUDA) is recorded with its one-line reason. Engines
(launcher.rank.entry.build_engine) are shared by the cells whose build reads nothing that
differs between them (`run`): checkpointing is a forward-time choice of the model
(`GPT.checkpointed`, set by models.set_activation_checkpointing from each cell's own
config), and only DeepSpeed and a pipeline build differently for another accumulation.
Per engine: one warm-up step (Adam creates its moments; a pipeline's first step also runs
shape inference), then one step per cell under launcher.planner.memory.ActivationCounter;
engine.state_bytes() counts the model states from the engine's own tensors. Rank 0 writes
the JSON (tests/e2e/test_plan_runs.py reads it) and, with --table, prints plan against measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

import engines
from launcher import models
from launcher.config import ACMode, ConfigError
from launcher.data.read import build_dataset
from launcher.device import local_device
from launcher.exits import exit_now
from launcher.host import HostInfo, deepspeed_env
from launcher.launch.checks.validate import validate
from launcher.launch.compose import CONF_DIR, compose_config, group_configs, recipe_configs
from launcher.parallel import ds_config
from launcher.planner import plan as planner
from launcher.planner.memory import ActivationCounter
from launcher.rank.entry import build_engine

PARTS = ("params", "grads", "optim")


def offered(model: str, world: int, recipes: list[str], overrides: tuple[str, ...] = ()) -> list[planner.Layout]:
    """The layouts `make plan` offers on `world` ranks of one node, for these recipes, for the
    model as the model.* overrides shape it (model.moe.experts sets the expert-parallel degrees)."""
    cfg, _, _ = compose_config([f"model={model}", *(o for o in overrides if o.startswith("model."))])
    hw = planner.Hardware(gpu_bytes=0, gpus_per_node=world, nnodes=1, tflops=planner.DEFAULT_TFLOPS)
    return planner.candidates(cfg, hw, recipe_configs(set(recipes)))


def compose(
    layout: planner.Layout, model: str, mb: int, seq: int, world: int, optim: str = "adamw", more: tuple[str, ...] = ()
):
    """A layout's config as `make train` composes it. A pipeline cuts each step's batch into
    parallel.pp_microbatches, at least one per stage under 1F1B: pp of them, and a
    micro-batch of at least pp sequences. Composed once per layout: each precision is its
    own conf/precision/ file on it (nothing in conf/ interpolates the precision group)."""
    extra = [f"parallel.pp_microbatches={layout.pp}"] if layout.pp > 1 else []
    cfg, _, _ = compose_config(
        [
            *layout.overrides(),
            f"model={model}",
            f"train.micro_batch={max(mb, layout.pp)}",
            f"train.seq_len={seq}",
            "logger=none",
            f"cluster.nproc_per_node={world}",
            f"optim={optim}",
            *extra,
            *more,
        ]
    )
    return cfg


def cell(cfg, accum: int, ac: str):
    """`train.grad_accum=... train.activation_checkpointing=...` on a composed config (plain
    values: nothing in conf/ interpolates them), validated as the launch side does. Hydra
    composes a config in about 0.15 s; the matrix has hundreds of cells per world size."""
    out = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, grad_accum=accum, activation_checkpointing=ACMode(ac))
    )
    validate(out, HostInfo.detect())
    return out


def predicted(cfg, layout: planner.Layout, rank: int, world: int) -> dict:
    pp_rank = rank // (world // layout.pp)  # the mesh puts pipeline stages outermost
    p, g, o, where, host = planner.model_states(cfg, layout, pp_rank)
    act = planner.activations(cfg, layout, cfg.train.activation_checkpointing, cfg.train.micro_batch, pp_rank)
    return {
        "params": p,
        "grads": g,
        "optim": o,
        "model_state": p + g + o,
        "host": sum(host.values()),
        "where": where,
        "activations": act,
    }


def measure_engine(cells: list, layout: planner.Layout, rank: int, world: int, device, scratch: Path) -> list[dict]:
    """One engine for cells that differ only in what its build does not read; a row per cell."""
    cfg, started = cells[0], time.perf_counter()
    if engines.spec(cfg.recipe.engine).deepspeed:  # what the launch side writes for DeepSpeed
        (scratch / ds_config.FILE).write_text(
            ds_config.text(ds_config.launch_config(cfg, world, device.type == "cuda"))
        )
    net = models.prepare(models.on_meta(cfg), cfg)
    engine = build_engine(cfg, net, device, rank, world, rank, scratch)
    built = time.perf_counter()
    data = build_dataset(cfg)

    def step(c) -> list:
        mb, accum = c.train.micro_batch, c.train.grad_accum
        batches = data.__getitems__(list(range(rank * mb * accum, (rank + 1) * mb * accum))).to(device)
        return [(b[:, :-1], b[:, 1:]) for b in batches.split(mb)]

    engine.train_step(step(cfg))
    # The model the engine runs: zero3 builds its own inside zero.Init; a pipeline's
    # stages run the blocks of `net` itself.
    runs = [net] + [m for m in engine.model.modules() if hasattr(m, "checkpointed") and m is not net]
    rows = []
    for c in cells:
        for m in runs:
            models.set_activation_checkpointing(m, c)
        with ActivationCounter(engine.model) as counter:
            engine.train_step(step(c))
        held = engine.state_bytes()
        rows.append(
            {
                "measured": {
                    "params": held.params,
                    "grads": held.grads,
                    "optim": held.optim,
                    "model_state": held.total,
                    "host": held.host,
                    "where": held.where,
                    "activations": counter.bytes,
                },
                "predicted": predicted(c, layout, rank, world),
            }
        )
    if rank == 0:
        print(
            f"{layout.label} {cfg.precision.name.value}: {len(cells)} cells, built in {built - started:.1f} s, "
            f"measured in {time.perf_counter() - built:.1f} s",
            flush=True,
        )
    del engine, net, runs
    if engines.spec(cfg.recipe.engine).deepspeed:
        from engines.zero.engine import restore_linear

        restore_linear()
    return rows


def run(args, rank: int, world: int) -> list[dict]:
    """Every cell. Cells share an engine where its build reads nothing that differs between
    them: checkpointing always (a forward-time choice), and the accumulation except under
    DeepSpeed (ds_config.json's gradient_accumulation_steps) and a pipeline (its stages fix
    the micro-batch shape at the first step); the other recipes take the micro-batches of
    a step as a list (Engine.train_step) and build the same engine."""
    device = local_device(int(os.environ.get("LOCAL_RANK", 0)))
    with tempfile.TemporaryDirectory(prefix="measure-") as scratch:  # each rank's ds_config.json
        return _run(args, rank, world, device, Path(scratch))


def _run(args, rank: int, world: int, device, scratch: Path) -> list[dict]:
    recipes = args.recipes.split(",") if args.recipes else sorted(p.stem for p in (CONF_DIR / "recipe").glob("*.yaml"))
    precisions = args.precisions.split(",") if args.precisions else ["fp32", "bf16", "fp16"]
    typed = group_configs("precision", set(precisions))
    rows = []
    for model, optim in itertools.product(args.models.split(","), args.optims.split(",")):
        for layout in offered(model, world, recipes, tuple(args.overrides)):
            for mb in [int(b) for b in args.micro_batches.split(",")]:
                composed = compose(layout, model, mb, args.seq_len, world, optim, tuple(args.overrides))
                for precision in precisions:
                    rows += measure_precision(
                        dataclasses.replace(composed, precision=typed[precision]),
                        args,
                        layout,
                        rank,
                        world,
                        device,
                        scratch,
                        {
                            "recipe": layout.recipe,
                            "layout": layout.label,
                            "model": model,
                            "micro_batch": mb,
                            "precision": precision,
                            "world": world,
                            "rank": rank,
                            "optim": optim,
                        },
                    )
    return rows


def measure_precision(base, args, layout, rank, world, device, scratch, key) -> list[dict]:
    """One layout at one precision: every accumulation x checkpointing cell."""
    rows = []
    groups: dict = {}
    for accum, ac in itertools.product([int(g) for g in args.grad_accums.split(",")], args.ac.split(",")):
        try:
            cfg = cell(base, accum, ac)
        except ConfigError as e:
            rows.append({**key, "grad_accum": accum, "ac": ac, "refused": str(e)})
            continue
        spec = engines.spec(cfg.recipe.engine)
        shared = not (spec.deepspeed or spec.parallelism.pp)
        groups.setdefault(None if shared else accum, []).append(cfg)
    for cells in groups.values():
        measured = measure_engine(cells, layout, rank, world, device, scratch)
        rows += [
            {**key, "grad_accum": c.train.grad_accum, "ac": c.train.activation_checkpointing.value, **r}
            for c, r in zip(cells, measured)
        ]
    return rows


def table(rows: list[dict]) -> str:
    """Plan against measured, the rank with the most model state of each cell."""
    lines = [
        "| world | layout | precision | accum | AC | model states plan / measured (MiB) | ratio "
        "| activations plan / measured (MiB) | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    cells: dict[tuple, dict] = {}
    for r in rows:
        k = (
            r["world"],
            r["layout"],
            r["optim"],
            r["model"],
            r["micro_batch"],
            r["precision"],
            r["grad_accum"],
            r["ac"],
        )
        if "refused" in r or k not in cells or r["measured"]["model_state"] > cells[k]["measured"]["model_state"]:
            cells[k] = r
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    for (world, layout, optim, _, _, precision, accum, ac), r in cells.items():
        layout = layout if optim == "adamw" else f"{layout} {optim}"
        if "refused" in r:
            lines.append(f"| {world} | {layout} | {precision} | {accum} | {ac} | refused: {r['refused']} | | | |")
            continue
        m, p = r["measured"], r["predicted"]
        lines.append(
            f"| {world} | {layout} | {precision} | {accum} | {ac} "
            f"| {mib(p['model_state'])} / {mib(m['model_state'])} | {m['model_state'] / p['model_state']:.3f} "
            f"| {mib(p['activations'])} / {mib(m['activations'])} | {m['activations'] / p['activations']:.3f} |"
        )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipes", default="", help="comma-separated; default: every recipe in conf/recipe")
    ap.add_argument("--models", default="gpt_tiny")
    ap.add_argument("--optims", default="adamw", help="comma-separated optim= names (conf/optim)")
    ap.add_argument("--micro-batches", default="2")
    ap.add_argument("--precisions", default="", help="default fp32,bf16,fp16 (fp16 is refused without CUDA)")
    ap.add_argument("--grad-accums", default="1,2")
    ap.add_argument("--ac", default="none,full,selective")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--overrides", nargs="*", default=[], help="more overrides for every cell, e.g. recipe.zero.extra=..."
    )
    ap.add_argument("--table", action="store_true", help="print plan against measured (rank 0)")
    return ap


def report(args, rows: list[dict], rank: int, world: int) -> str | None:
    """Every rank's rows to rank 0, which writes them to args.out: the table (--table) on rank 0."""
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank != 0:
        return None
    everyone = [r for per_rank in gathered for r in per_rank]
    Path(args.out).write_text(json.dumps(everyone, indent=1) + "\n")
    return table(everyone) if args.table else None


def main() -> None:
    args = parser().parse_args()
    deepspeed_env()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    printed = report(args, run(args, rank, world), rank, world)
    if printed is not None:
        print(printed, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now(0)  # as a rank: no interpreter teardown, which can abort a finished gloo process

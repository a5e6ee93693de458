#!/usr/bin/env python
"""Measure what each recipe's engine really holds and saves, next to the planner's
prediction, for several configurations in one torchrun job.

    torchrun --nproc-per-node 2 scripts/measure_memory.py --recipes ddp --out mem.json

Per configuration: build the engine exactly as a rank does (launcher.train.build_engine),
run one training step on real data with launcher.memory.ActivationCounter, and record
engine.state_bytes() (model states) and the saved-activation bytes, beside
launcher.plan's model_states() and activations() for the same layout. Rank 0 writes the
JSON (tests/test_plan.py and `make bench` read it).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from launcher import ds_config, models
from launcher import plan as planner
from launcher.cli import compose_config
from launcher.config import Strategy, validate
from launcher.data import build_dataset
from launcher.device import HostInfo, local_device
from launcher.memory import ActivationCounter
from launcher.train import build_engine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipes", default="ddp")
    ap.add_argument("--models", default="gpt_tiny,gpt_small")
    ap.add_argument("--micro-batches", default="2,4")
    ap.add_argument("--ac", default="none,full")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = local_device(int(__import__("os").environ.get("LOCAL_RANK", 0)))
    results = []
    tmp = Path(tempfile.mkdtemp(prefix="measure-"))
    for recipe, model, mb, ac in itertools.product(args.recipes.split(","), args.models.split(","),
                                                   [int(b) for b in args.micro_batches.split(",")],
                                                   args.ac.split(",")):
        # A pipeline cuts each batch into parallel.pp_microbatches: 2 fits every micro-batch here.
        extra = ["parallel.pp_microbatches=2"] if recipe == "pp" else []
        cfg, _, _ = compose_config([f"recipe={recipe}", f"model={model}", f"train.micro_batch={mb}",
                                    f"train.activation_checkpointing={ac}", f"train.seq_len={args.seq_len}",
                                    "logger=none", f"cluster.nproc_per_node={world}", *extra])
        validate(cfg, HostInfo.detect())
        if cfg.recipe.strategy == Strategy.zero:  # what the launch side writes for DeepSpeed
            (tmp / ds_config.FILE).write_text(ds_config.text(ds_config.launch_config(cfg, world, device.type == "cuda")))
        engine = build_engine(cfg, models.prepare(models.on_meta(cfg), cfg), device, rank, world, rank, tmp)
        batch = build_dataset(cfg).__getitems__(list(range(rank * mb, rank * mb + mb))).to(device)
        # A warm-up step first: the pipeline's first step also holds its shape-inference
        # pass; the planner predicts the steady state every later step holds.
        engine.train_step([(batch[:, :-1], batch[:, 1:])])
        with ActivationCounter(engine.model) as counter:
            engine.train_step([(batch[:, :-1], batch[:, 1:])])
        held = engine.state_bytes()
        layout = planner.layout_for(cfg, world)
        pp_rank = rank // (world // layout.pp)  # the mesh puts pipeline stages outermost
        p, g, o, _, _ = planner.model_states(cfg, layout, pp_rank)
        predicted_act = planner.activations(cfg, layout, cfg.train.activation_checkpointing, mb, pp_rank)
        results.append({"recipe": recipe, "model": model, "micro_batch": mb, "ac": ac, "rank": rank,
                        "measured": {"params": held.params, "grads": held.grads, "optim": held.optim,
                                     "model_state": held.total, "activations": counter.bytes},
                        "predicted": {"params": p, "grads": g, "optim": o, "model_state": p + g + o,
                                      "activations": predicted_act}})
        del engine, batch
        gc.collect()
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(args.out).write_text(json.dumps([r for per_rank in gathered for r in per_rank], indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

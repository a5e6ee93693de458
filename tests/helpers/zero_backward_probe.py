"""The gradient elements a ZeRO rank holds in `param.grad` when backward has ended, just
before DeepSpeed reduces them (one micro-batch a step, bf16, the recipe's own config).

    python -m torch.distributed.run --standalone --nproc-per-node N tests/helpers/zero_backward_probe.py OUT.json RECIPE...

zero1 (without overlap_comm, its default) leaves the reduction until backward has ended
(stage_1_and_2.py::reduce_gradients), so its whole gradients exist then; zero2 reduces
them through its buckets as backward makes them. launcher/planner/footprint.py::grads_at_peak
counts the first; tests/e2e/test_zero.py reads OUT.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import probes
import torch
import torch.distributed as dist

from launcher import models
from launcher.exits import exit_now
from launcher.launch.compose import compose_config
from launcher.rank.entry import build_engine


def held_at_reduction(recipe: str, rank: int, world: int, scratch: Path) -> int:
    cfg, _, _ = compose_config(
        [
            f"recipe={recipe}",
            "model=gpt_tiny",
            "precision=bf16",
            "train.micro_batch=2",
            "train.seq_len=32",
            "train.grad_accum=1",
            f"cluster.nproc_per_node={world}",
        ]
    )
    run_dir = probes.run_dir(cfg, scratch / recipe, rank, world)
    engine = build_engine(
        cfg, models.prepare(models.on_meta(cfg), cfg), torch.device("cpu"), rank, world, rank, run_dir
    )
    opt, seen = engine.engine.optimizer, []
    for name in ("reduce_gradients", "overlapping_partition_gradients_reduce_epilogue"):  # stage 1, stage 2

        def counting(*args, _original=getattr(opt, name), **kwargs):
            seen.append(sum(p.grad.numel() for p in engine.model.parameters() if p.grad is not None))
            return _original(*args, **kwargs)

        setattr(opt, name, counting)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 33), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        engine.train_step([(tokens[:, :-1], tokens[:, 1:])])
    return seen[-1]


def main() -> None:
    out, recipes = Path(sys.argv[1]), sys.argv[2:]
    rank, world, scratch = probes.join("zero-backward-")
    held = {recipe: held_at_reduction(recipe, rank, world, scratch) for recipe in recipes}
    everyone = [None] * world
    dist.all_gather_object(everyone, held)
    if rank == 0:
        out.write_text(json.dumps({"world_size": world, "ranks": everyone}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now(0)  # as a rank: no interpreter teardown, which can abort a finished gloo process

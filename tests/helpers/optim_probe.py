"""Each optimizer (launcher/optim/) on the ddp and the fsdp engine of the same process group,
trained on the same batches: how far fsdp's loss on a held-out batch is from ddp's after 3
steps, relative (a sharded matrix stepped whole: Adafactor's rows and columns, Muon's
Newton-Schulz), and how
far a 4th step after a save and a load into a new engine (ddp's files, fsdp's DCP) is from
the 4th step of the engine that saved.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/helpers/optim_probe.py OUT.json NAME...

tests/e2e/test_optimizers.py reads OUT.json: {name: {"fsdp_vs_ddp": .., "ddp_resumed": .., "fsdp_resumed": ..}}.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from launcher import models
from launcher.exits import exit_now
from launcher.launch.compose import compose_config
from launcher.rank.entry import build_engine


def batches(cfg, rank: int, step: int) -> list:
    tokens = torch.randint(
        0, cfg.model.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1000 * step + rank)
    )
    return [(tokens[:, :-1], tokens[:, 1:])]


def engine(optim: str, recipe: str, rank: int, world: int, scratch: Path):
    cfg, _, _ = compose_config(
        [
            f"recipe={recipe}",
            f"optim={optim}",
            "model=gpt_tiny",
            "precision=fp32",
            "train.micro_batch=2",
            "train.seq_len=32",
            "train.steps=8",
            "optim.warmup_steps=1",
            f"cluster.nproc_per_node={world}",
        ]
    )
    return cfg, build_engine(
        cfg, models.prepare(models.on_meta(cfg), cfg), torch.device("cpu"), rank, world, rank, scratch
    )


def distance(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def probe(optim: str, rank: int, world: int, scratch: Path) -> dict:
    out, losses = {}, {}
    for recipe in ("ddp", "fsdp"):
        cfg, e = engine(optim, recipe, rank, world, scratch)
        for step in range(1, 4):
            e.train_step(batches(cfg, rank, step))
        held_out = batches(cfg, rank, 0)
        losses[recipe] = e.eval_step(held_out).loss.item()
        folder = scratch / f"{optim}-{recipe}"
        e.save(folder)
        dist.barrier()
        e.train_step(batches(cfg, rank, 4))
        _, fresh = engine(optim, recipe, rank, world, scratch)
        fresh.load(folder)
        fresh.train_step(batches(cfg, rank, 4))
        out[f"{recipe}_resumed"] = distance(e.consolidated_state_dict(), fresh.consolidated_state_dict())
    out["fsdp_vs_ddp"] = abs(losses["fsdp"] - losses["ddp"]) / losses["ddp"]
    return out


def main() -> None:
    out, names = Path(sys.argv[1]), sys.argv[2:]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    scratch = [tempfile.mkdtemp(prefix="optim-probe-") if rank == 0 else None]
    dist.broadcast_object_list(scratch)
    found = {name: probe(name, rank, world, Path(scratch[0])) for name in names}
    if rank == 0:
        out.write_text(json.dumps(found, indent=1) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now(0)  # as a rank: no interpreter teardown, which can abort a finished gloo process

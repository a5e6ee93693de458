"""Packed micro-batches (inputs, targets, positions) through each engine's real step, on
every rank, against one process training the whole model on the same rows.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/helpers/packing_probe.py OUT.json LAYOUT...

LAYOUT is a name of LAYOUTS. Each layout's engine is built through the rank's own
build_engine (fp32, gpt_tiny, data.document_masking=true) and runs STEPS train steps and
one eval_step on hand-built packed rows: samples of several lengths, a prompt (-100),
padding at the end, and a row with no counted target at all. Every layout sees the same 4
rows a step as 4 micro-batches of one row (ddp, fsdp, zero: 2 per rank; tp and pp: all 4
on each rank, the pipeline's schedule cutting them into 4), so the global loss is the mean
of the 4 rows' means, as the reference computes it. OUT.json: each layout's global losses
(the loop's owners' sum over the data-parallel ranks), the reference's with and without
the positions. tests/e2e/test_packing_runs.py reads it.
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
from launcher.parallel import degrees as D
from launcher.rank.engine import build_optimizer, build_scheduler, owners_sum
from launcher.rank.entry import build_engine

ROWS, SEQ, STEPS = 4, 32, 2
COMMON = [
    "model=gpt_tiny",
    "precision=fp32",
    "train.micro_batch=1",
    f"train.seq_len={SEQ}",
    "train.steps=10",
    "optim.warmup_steps=1",
    "data.document_masking=true",
    "cluster.nproc_per_node=2",
]
LAYOUTS = {
    "ddp": ["recipe=ddp", "train.grad_accum=2"],
    "fsdp": ["recipe=fsdp", "train.grad_accum=2"],
    "zero3": ["recipe=zero3", "train.grad_accum=2"],
    # the sequence split between the blocks' norms, the positions whole: each rank's attention gathers it
    "tp_sp": ["recipe=tp", "parallel.tp=2", "parallel.sequence_parallel=true", "train.grad_accum=4"],
    "pp": [
        "recipe=pp",
        "parallel.pp=2",
        "parallel.pp_microbatches=4",
        "parallel.pp_virtual_stages=1",
        "parallel.pp_schedule=1f1b",
        "train.grad_accum=4",
    ],
}


def packed_rows(step: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """ROWS packed windows of SEQ tokens for `step`: (inputs, targets, positions) each (1, SEQ)."""
    g = torch.Generator().manual_seed(100 + step)
    rows = []
    for r in range(ROWS):
        lengths = [7, 12, 1, 8] if r % 2 == 0 else [15, 3, 10]
        tokens, targets, positions = [], [], []
        for i, n in enumerate(lengths):
            sample = torch.randint(0, 256, (n + 1,), generator=g)
            y = sample[1:].clone()
            if i == 1:
                y[: n // 2] = -100  # a prompt
            tokens.append(sample[:-1])
            targets.append(y)
            positions.append(torch.arange(n))
        pad = SEQ - sum(lengths)
        tokens.append(torch.zeros(pad, dtype=torch.long))
        targets.append(torch.full((pad,), -100))
        positions.append(torch.arange(pad))
        y = torch.cat(targets)
        if r == 3:
            y = torch.full_like(y, -100)  # all prompt: nothing counts in this row
        rows.append((torch.cat(tokens)[None], y[None], torch.cat(positions)[None]))
    return rows


def reference(cfg, packed: bool) -> dict:
    """The whole model in this process: the 4 rows' mean loss a step, then the update
    (clipped as the engines clip); `packed` False: the same rows without their positions."""
    model = models.build(cfg, torch.device("cpu"))
    optimizer = build_optimizer(model, cfg.optim, torch.device("cpu"))
    scheduler = build_scheduler(optimizer, cfg)

    def loss_of(step: int) -> torch.Tensor:
        return torch.stack([model(*(row if packed else row[:2])) for row in packed_rows(step)]).mean()

    losses = []
    for step in range(STEPS):
        loss = loss_of(step)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        return {"train": losses, "eval": loss_of(STEPS).item()}


def run_layout(name: str, rank: int, world: int, scratch: Path) -> dict:
    cfg, _, _ = compose_config(COMMON + LAYOUTS[name])
    folder = probes.run_dir(cfg, scratch / name, rank, world)
    engine = build_engine(cfg, models.prepare(models.on_meta(cfg), cfg), torch.device("cpu"), rank, world, rank, folder)
    deg = D.degrees(cfg, world)
    mine = slice(deg.dp_rank(rank) * 2, deg.dp_rank(rank) * 2 + 2) if deg.dp > 1 else slice(0, ROWS)
    out = {"train": []}
    cpu = torch.device("cpu")
    for step in range(STEPS):
        result = engine.train_step(packed_rows(step)[mine])
        out["train"].append(owners_sum(result.loss, result.loss_owner, cpu).item() / deg.dp)
    result = engine.eval_step(packed_rows(STEPS)[mine])
    out["eval"] = owners_sum(result.loss, result.loss_owner, cpu).item() / deg.dp
    return out


def main() -> None:
    out, layouts = Path(sys.argv[1]), sys.argv[2:]
    rank, world, scratch = probes.join("packing-probe-")
    results = {name: run_layout(name, rank, world, scratch) for name in layouts}
    if rank == 0:
        cfg, _, _ = compose_config(COMMON + LAYOUTS["ddp"])
        results["reference"] = reference(cfg, packed=True)
        results["unpacked"] = reference(cfg, packed=False)
        out.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now(0)  # as a rank: no interpreter teardown, which can abort a finished gloo process

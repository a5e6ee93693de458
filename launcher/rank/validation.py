"""train.eval_every: the loss on held-out data, forward only, every N steps. Each data-
parallel rank evaluates its share of the same train.eval_samples every time (made once,
on its device); each engine runs its own forward (Engine.eval_step), so sharded, tensor-
and pipeline-parallel models evaluate as they train. The loop reduces and logs the result
(val/loss, val/perplexity) with the step's other figures, in the same host read."""

from __future__ import annotations

import torch

from launcher.data.read import build_val_dataset
from launcher.parallel.context import local_positions
from launcher.rank.engine import StepResult


def held_out_batches(job, cp: int, cp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """train.eval_every's micro-batches of this data-parallel rank, on its device, made once:
    the same held-out samples at every evaluation (launcher/data/read.py::build_val_dataset)."""
    cfg, mb = job.cfg, job.cfg.train.micro_batch
    n = cfg.train.eval_samples // (job.dp_size * mb)  # whole micro-batches (launch/held_out.py)
    data = build_val_dataset(cfg, job.dataset, job.run_dir)
    first = job.dp_rank * n * mb
    out = []
    for k in range(n):
        batch = data.__getitems__(list(range(first + k * mb, first + (k + 1) * mb))).to(job.device)
        x, y = batch[:, :-1], batch[:, 1:]
        out.append((local_positions(x, cp_rank, cp), local_positions(y, cp_rank, cp)) if cp > 1 else (x, y))
    return out


def held_out_loss(job, batches: list) -> StepResult:
    """The engine's forward-only loss over the held-out micro-batches, a step's worth
    (grad_accum micro-batches: a pipeline's schedule splits that whole) at a time."""
    g = job.grad_accum
    parts = [(job.engine.eval_step(batches[i:i + g]), len(batches[i:i + g])) for i in range(0, len(batches), g)]
    loss = sum(r.loss * n for r, n in parts) / len(batches)
    return StepResult(loss=loss, grad_norm=parts[0][0].grad_norm, loss_owner=parts[0][0].loss_owner)

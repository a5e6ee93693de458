"""train.eval_every: the loss on held-out data, forward only, every N steps. Each data-
parallel rank evaluates its share of the same train.eval_samples every time (made once,
on its device); each engine runs its own forward (Engine.eval_step), so sharded, tensor-
and pipeline-parallel models evaluate as they train. The loop reduces and logs the result
(val/loss, val/perplexity) with the step's other figures, in the same host read."""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from launcher.data.read import IGNORE, micro_batch, val_sets
from launcher.device import synchronize
from launcher.models.gpt import counting
from launcher.parallel.context import local_positions
from launcher.rank.engine import StepResult, owners_sum


class HeldOut:
    """The loop's evaluations: the held-out batches made once, the loss when due, on every
    rank (its forwards may hold collectives), its time kept out of the step times."""

    def __init__(self, job, cp: int, cp_rank: int):
        self.job, self.every = job, job.cfg.train.eval_every
        self.batches = held_out_batches(job, cp, cp_rank) if self.every else []

    def due(self, step: int, last: int) -> bool:
        return bool(self.every) and (step % self.every == 0 or step == last)

    def evaluate(self, step: int, last: int, watchdog, meter) -> dict[str, torch.Tensor] | None:
        """`evaluate` after step `step` where due, else None."""
        if not self.due(step, last):
            return None
        device = self.job.device
        synchronize(device)  # the step's kernels end before the evaluation's clock starts
        t_eval = time.perf_counter()
        with watchdog.paused():  # a large train.eval_samples may outlast dist.timeout_s
            val = evaluate(self.job, self.batches, device)
            synchronize(device)
        meter.start += time.perf_counter() - t_eval  # out of the step times
        return val


def held_out_batches(job, cp: int, cp_rank: int) -> list[tuple[str, float, list, float | None]]:
    """train.eval_every's micro-batches of this data-parallel rank, on its device, made once:
    the same held-out samples at every evaluation (launcher/data/read.py::val_sets); per
    source of a mixture, train.eval_samples each: (name, weight, micro-batches, their counted
    targets, None under context parallel)."""
    cfg, mb = job.cfg, job.cfg.train.micro_batch
    n = cfg.train.eval_samples // (job.dp_size * mb)  # whole micro-batches (launch/checks/data.py)
    first = job.dp_rank * n * mb
    out = []
    for name, weight, data in val_sets(cfg, job.dataset):
        batches = []
        for k in range(n):
            batch = data.__getitems__(list(range(first + k * mb, first + (k + 1) * mb))).to(job.device)
            parts = micro_batch(batch, cfg.data.document_masking)  # data=chat: the loss on the counted targets
            batches.append(tuple(local_positions(t, cp_rank, cp) for t in parts) if cp > 1 else parts)
        out.append((name, weight, batches, counted(job, batches) if cp == 1 else None))
    return out


def counted(job, batches: list) -> float | None:
    """data=chat: what each held-out loss call divides by (launcher/models/gpt.py::COUNTED):
    the set's counted targets over the data-parallel ranks (counted once: the same samples
    every evaluation) over this rank's calls, so val/loss is the mean over every counted
    token. None where every target counts."""
    if not hasattr(job.dataset, "packed"):
        return None
    total = torch.tensor([sum(int((b[1] != IGNORE).sum()) for b in batches)], dtype=torch.int64)
    dist.all_reduce(total, group=job.preemption.group)
    p = job.cfg.parallel  # a pipeline's schedule cuts each step's worth into its own micro-batches
    calls = len(batches) * (p.pp_microbatches / job.grad_accum if p.pp > 1 else 1)
    return max(1, int(total) // (job.world_size // job.dp_size)) / (job.dp_size * max(1, calls))


def held_out_loss(job, batches: list) -> StepResult:
    """The engine's forward-only loss over the held-out micro-batches, a step's worth
    (grad_accum micro-batches: a pipeline's schedule splits that whole) at a time."""
    g = job.grad_accum
    parts = [(job.engine.eval_step(batches[i : i + g]), len(batches[i : i + g])) for i in range(0, len(batches), g)]
    loss = sum(r.loss * n for r, n in parts) / len(batches)
    return StepResult(loss=loss, grad_norm=parts[0][0].grad_norm, loss_owner=parts[0][0].loss_owner)


def evaluate(job, held_out: list, device: torch.device) -> dict[str, torch.Tensor]:
    """Every set's loss summed over its owners (a collective each, on every rank), by
    metric name: val/loss, and for a mixture val/<name>/loss per source with val/loss
    their weighted mean (the loss the blend expects)."""
    losses = {}
    for name, weight, batches, per_call in held_out:
        with counting(per_call):
            r = held_out_loss(job, batches)
        losses[name] = (weight, owners_sum(r.loss, r.loss_owner, device))
    if "" in losses:
        return {"val/loss": losses[""][1]}
    return {"val/loss": sum(w * t for w, t in losses.values()), **{f"val/{n}/loss": t for n, (_, t) in losses.items()}}


def val_metrics(read: dict[str, float], slices: int) -> dict[str, float]:
    """The host's values of `evaluate`, per slice (the owners' sum over the data-parallel
    and context-parallel slices), and val/perplexity."""
    out = {k: v / slices for k, v in read.items()}
    out["val/perplexity"] = math.exp(min(out["val/loss"], 700.0))
    return out

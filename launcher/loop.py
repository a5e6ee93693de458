"""The training loop, top to bottom. Every recipe runs through here; the engine decides
how micro-batches become an optimizer step, the loop decides when to log and save."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from launcher.checkpoint import Checkpointer, step_name
from launcher.config import Config
from launcher.data import build_loader, loss_floor
from launcher.device import memory_stats, peak_flops, reset_peak_memory, synchronize
from launcher.metrics import RankZeroLogger, Throughput
from launcher.preempt import EXIT_PREEMPTED, Preemption


@dataclass
class Job:
    """What train.py built for this rank."""

    cfg: Config
    run_dir: Path
    engine: object
    dataset: object
    device: torch.device
    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    grad_accum: int
    flops_per_token: float
    compute_dtype: torch.dtype | None
    preemption: Preemption


def run(job: Job) -> int:
    """Train to the last step (0), or until a stop signal (EXIT_PREEMPTED)."""
    cfg, engine, device = job.cfg, job.engine, job.device
    global_batch = cfg.train.micro_batch * job.grad_accum * job.dp_size
    tokens_per_step = global_batch * cfg.train.seq_len

    # ------------------------------------------------------------------ resume
    ckpt = Checkpointer(Path(cfg.checkpoint.dir or job.run_dir / "checkpoints"), cfg.checkpoint.keep,
                        job.rank, job.world_size)
    step, samples_seen = 0, 0
    start_from = ckpt.resolve(cfg.checkpoint.resume)
    if start_from is not None:
        state = ckpt.load(start_from, engine)
        step, samples_seen = state.step, state.samples_seen

    log = RankZeroLogger(cfg, job.run_dir, job.rank, cfg.train.steps, step)
    if start_from is not None:
        log.print(f"resumed from {start_from} at step {step} ({samples_seen:,} samples seen)")
    log.print(f"{cfg.recipe.name}: {job.world_size} rank(s) on {device.type}, global batch {global_batch} "
              f"({cfg.train.micro_batch} x {job.grad_accum} accum x {job.dp_size} dp), {tokens_per_step:,} tokens/step")

    loader = build_loader(cfg, job.dataset, samples_seen, global_batch, job.dp_rank, job.dp_size, device)
    batches = iter(loader)
    meter = Throughput(tokens_per_step, global_batch, job.flops_per_token,
                       peak_flops(device, job.compute_dtype) * job.world_size)
    reset_peak_memory(device)
    first_step = step

    # ------------------------------------------------------------------ loop
    last = min(cfg.train.steps, cfg.train.stop_at or cfg.train.steps)
    saved_at, preempted = None, False
    while step < last:
        t0 = time.perf_counter()
        micro_batches = []
        for _ in range(job.grad_accum):
            batch = next(batches).to(device, non_blocking=True)
            micro_batches.append((batch[:, :-1], batch[:, 1:]))
        meter.data_wait += time.perf_counter() - t0

        result = engine.train_step(micro_batches)
        step += 1
        samples_seen += global_batch
        meter.steps += 1

        if step % cfg.logger.log_every == 0 or step == last:
            loss = result.loss.detach().clone()
            dist.all_reduce(loss, op=dist.ReduceOp.SUM)
            synchronize(device)
            metrics = {"step": step, "loss": loss.item() / job.world_size, "lr": engine.lr(),
                       "grad_norm": float(result.grad_norm), **meter.rates(), **memory_stats(device),
                       **engine.state_bytes().as_metrics()}
            if result.loss_scale is not None:
                metrics["loss_scale"] = result.loss_scale
            log.log(metrics)

        every = cfg.checkpoint.every
        stopping_early = step == last < cfg.train.steps
        if (every and step % every == 0) or stopping_early or (step == last and cfg.checkpoint.save_final):
            saved_at = ckpt.save(step, samples_seen, engine)
            log.print(f"checkpoint {saved_at}")
            meter.start = time.perf_counter()  # keep save time out of the step time

        if job.preemption.requested():  # every rank agrees, so all stop after this step
            if saved_at is None or saved_at.name != step_name(step):
                saved_at = ckpt.save(step, samples_seen, engine)
            if job.rank == 0:
                job.preemption.write_marker(job.run_dir, step, saved_at)
            log.print(f"stop signal: saved {saved_at} after step {step}; exiting as preempted")
            preempted = True
            break

    # ------------------------------------------------------------------ summary
    summary = summarize(job, log.history, step - first_step)
    summary["preempted"] = preempted
    log.finish(summary)
    return EXIT_PREEMPTED if preempted else 0


def summarize(job: Job, history: list[dict], steps_run: int) -> dict:
    """Final figures (rank 0's view) plus a digest of each rank's weights."""
    digests = [None] * job.world_size
    dist.all_gather_object(digests, weights_digest(job.engine))
    if job.rank != 0:
        return {"steps": job.cfg.train.steps}
    # Skip the first interval (start-up, allocator warm-up) when there are more.
    steady = history[1:] if len(history) > 1 else history
    floor = loss_floor(job.cfg)
    out = {
        "steps": job.cfg.train.steps,
        "steps_this_launch": steps_run,
        "final_loss": history[-1]["loss"] if history else float("nan"),
        "loss_floor": floor if floor is not None else float("nan"),
        "tokens_per_s": _mean(steady, "tokens_per_s"),
        "mfu": _mean(steady, "mfu"),
        "data_wait_frac": _mean(steady, "data_wait_frac"),
        "peak_mem_bytes": max((h["mem/peak_bytes"] for h in history), default=0),
        "model_state_bytes": history[-1]["mem/model_state_bytes"] if history else 0,
        "model_state_where": job.engine.state_bytes().where,  # params/grads/optim: device or cpu (offload)
        "world_size": job.world_size,
        "weights_digest_per_rank": digests,
    }
    return out


def _mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows) if rows else float("nan")


def weights_digest(engine) -> str:
    """sha256 of this rank's local parameter bytes, in name order."""
    h = hashlib.sha256()
    for name, p in sorted(engine.model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

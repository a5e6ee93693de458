"""The training loop, top to bottom. Every recipe runs through here; the engine decides
how micro-batches become an optimizer step, the loop decides when to log and save. Each
concern is one call: the batches (rank/feed.py), the step with its back-off and
measurements (rank/step.py), the evaluation (rank/evaluate.py), the loss guard
(rank/guard.py), the checkpoints (rank/saves.py), fault injection (rank/faults.py)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import engines
from launcher import models
from launcher.config import Config
from launcher.data.read import loss_floor
from launcher.device import host_values, memory_stats, peak_flops, reset_peak_memory
from launcher.exits import EXIT_CHECKPOINT_FAILED, EXIT_PREEMPTED
from launcher.parallel.degrees import degrees
from launcher.rank import faults
from launcher.rank.checkpoint import Checkpointer
from launcher.rank.engine import Engine, StepResult, local_shard, owners_sum
from launcher.rank.evaluate import HeldOut, val_metrics
from launcher.rank.feed import Feed
from launcher.rank.guard import LossGuard
from launcher.rank.metrics import RankZeroLogger, Throughput
from launcher.rank.preempt import Preemption
from launcher.rank.profiler import StepProfiler
from launcher.rank.saves import Saves
from launcher.rank.step import Stepper
from launcher.rank.straggler import Stragglers
from launcher.rank.watchdog import Watchdog


@dataclass
class Job:
    """What rank/entry.py built for this rank."""

    cfg: Config
    run_dir: Path
    engine: Engine
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
    checkpointer: Checkpointer
    start_from: Path | None
    """The checkpoint to resume (Checkpointer.resolve, before the engine was built), or None."""
    startup: dict | None = None
    """This rank's start-up figures (launcher.device.startup_peaks), taken when the engine was ready."""

    @property
    def global_batch(self) -> int:
        """Samples a step over all ranks (train.oom_backoff keeps it: a smaller micro-batch, more accumulation)."""
        return self.cfg.train.micro_batch * self.grad_accum * self.dp_size


def run(job: Job) -> int:
    """Train to the last step (0), or until a stop signal (EXIT_PREEMPTED)."""
    cfg, engine = job.cfg, job.engine
    first, samples_seen = resume(job)
    log = RankZeroLogger(cfg, job.run_dir, job.rank, cfg.train.steps, first)
    announce(job, log, first, samples_seen)
    feed = Feed(job, samples_seen, log.print)  # the loader from the data position
    held_out = HeldOut(job, feed.cp, feed.cp_rank)  # train.eval_every
    meter = throughput(job, log)
    last = last_step(cfg, first, log)
    watchdog = Watchdog(cfg.dist.timeout_s, job.rank, job.world_size, job.run_dir).start(first)
    profiler = StepProfiler(cfg.profile, job.run_dir, job.rank, job.device)
    engine.guard = guard = LossGuard(cfg, job.device, job.dp_size * feed.cp, log.print)  # train.max_bad_steps
    stragglers = Stragglers(cfg, engine, job.device, job.rank, job.world_size, log.print)  # train.straggler_factor
    stepper = Stepper(job, feed, meter, watchdog, guard, stragglers, log, first, last)
    saves = Saves(job, watchdog, log, meter, first)
    job.preemption.started(first)
    step, preempted = first, False
    while step < last:
        logged = (step + 1) % cfg.logger.log_every == 0 or step + 1 == last or held_out.due(step + 1, last)
        with faults.injected(job, step + 1):  # debug.fault: its one hook in the loop
            profiler.begin(step + 1)
            micro_batches = feed.take()
            result = stepper.run(step + 1, micro_batches, logged)
        step += 1
        routed = models.after_step(engine.model, cfg)  # an MoE's expert load, every step (balance=bias moves)
        profiler.end(step)
        saves.warm(step)  # checkpoint.async_save: after the launch's first step
        watchdog.progress(step)
        val = held_out.evaluate(step, last, watchdog, meter)  # on a logged step, or None
        if logged:
            log.log(step_metrics(job, step, result, val, stepper) | routed)
        stop = saves.poll() or guard.recover(engine, saves) or saves.due(step, feed.samples, last)
        if stop is not None:
            return stop
        if job.preemption.requested(step):  # every rank agrees, so all stop after this step
            stop = saves.stop(step, feed.samples)
            if stop is not None:
                return stop
            preempted = True
            break
    return finish(job, log, saves, watchdog, profiler, stepper, step - first, preempted)


def resume(job: Job) -> tuple[int, int]:
    """(step, samples seen) of the checkpoint this launch resumes, or (0, 0)."""
    if job.start_from is None:
        return 0, 0
    state = job.checkpointer.load(job.start_from, job.engine)
    return state.step, state.samples_seen


def announce(job: Job, log: RankZeroLogger, step: int, samples_seen: int) -> None:
    """The console's first lines: where it resumes, the batch, the mesh, fp8's layers."""
    cfg = job.cfg
    if job.start_from is not None:
        log.print(f"resumed from {job.start_from} at step {step} ({samples_seen:,} samples seen)")
    log.print(
        f"{cfg.recipe.name}: {job.world_size} rank(s) on {job.device.type}, global batch {job.global_batch} "
        f"({cfg.train.micro_batch} x {job.grad_accum} accum x {job.dp_size} dp), "
        f"{job.global_batch * cfg.train.seq_len:,} tokens/step"
    )
    d = degrees(cfg, job.world_size)
    if job.dp_size != job.world_size or engines.spec(cfg.recipe.engine).meshed:
        log.print(
            f"mesh: pp {d.pp} x dp_replicate {d.dp_replicate} x dp_shard {d.dp_shard} x cp {d.cp} x tp {d.tp}"
            + (f"; experts over ep {d.ep} x efsdp {job.world_size // d.ep}" if d.ep > 1 else "")
        )
    if cfg.precision.fp8:
        n = sum(type(m).__name__ == "Float8Linear" for m in job.engine.model.modules())
        log.print(
            f"precision=fp8: {n} linear layers in float8 (torchao, rowwise scales"
            f"{'; emulated' if cfg.precision.fp8_emulate else ''}), the rest in bf16"
        )


def throughput(job: Job, log: RankZeroLogger) -> Throughput:
    """The rates' meter (against the device's peak where known), from here; the peak memory
    counted from here too."""
    peak, guessed = peak_flops(job.device, job.compute_dtype, job.cfg.cluster.peak_tflops)
    if guessed:
        log.print(guessed)
    meter = Throughput(
        job.global_batch * job.cfg.train.seq_len, job.global_batch, job.flops_per_token, peak and peak * job.world_size
    )
    reset_peak_memory(job.device)
    return meter


def last_step(cfg: Config, step: int, log: RankZeroLogger) -> int:
    """train.steps, or train.stop_at where it is ahead."""
    if cfg.train.stop_at is not None and step < cfg.train.stop_at:
        return min(cfg.train.steps, cfg.train.stop_at)
    if cfg.train.stop_at is not None:  # command.sh run again, a requeue: the stop is behind
        log.print(
            f"train.stop_at={cfg.train.stop_at} is behind the checkpoint (step {step}): "
            f"training on to train.steps={cfg.train.steps}"
        )
    return cfg.train.steps


def step_metrics(job: Job, step: int, result: StepResult, val: dict | None, stepper: Stepper) -> dict:
    """A log step's figures, on every rank (the loss's all-reduce, the straggler gather and
    data=chat's counts are collectives); rank 0 writes them. A new per-step metric is one
    more entry in `metrics`."""
    device, engine, slices = job.device, job.engine, job.dp_size * stepper.feed.cp
    loss = owners_sum(result.loss, result.loss_owner, device)  # summed over the owners, divided by the slices
    scaled = result.loss_scale is not None
    # One host synchronisation for every scalar, before the rates (it waits for the device).
    read = host_values(
        device,
        loss,
        result.grad_norm,
        *((result.loss_scale, stepper.skipped) if scaled else ()),
        *(val.values() if val is not None else ()),
    )
    metrics = {
        "step": step,
        "loss": read[0] / slices,
        "lr": engine.lr(),
        "grad_norm": read[1],
        **stepper.meter.rates(),
        **memory_stats(device),
        **engine.state_bytes().as_metrics(),
        **stepper.activations.metrics,
        **stepper.guard.metrics(),
        **stepper.stragglers.report(step),
        **stepper.feed.metrics(step),
    }
    if scaled:
        metrics["loss_scale"] = read[2]
        metrics["skipped_steps"] = int(read[3])
    if val is not None:
        metrics |= val_metrics(dict(zip(val, read[-len(val) :])), slices)
    return metrics


def finish(
    job: Job,
    log: RankZeroLogger,
    saves: Saves,
    watchdog: Watchdog,
    profiler: StepProfiler,
    stepper: Stepper,
    steps_run: int,
    preempted: bool,
) -> int:
    """The last async save published, summary.json written; the rank's exit code."""
    cfg = job.cfg
    if not saves.settle():  # the last async save, published before the run ends
        return EXIT_CHECKPOINT_FAILED
    watchdog.stop()
    profiler.finish()  # stopped inside the window (preempted, train.stop_at): keep what was recorded
    summary = summarize(
        job,
        log.history,
        steps_run,
        digest=cfg.debug.final_digest and not preempted,
        skipped_steps=int(stepper.skipped) if cfg.precision.name.value == "fp16" else None,
    )
    summary["preempted"] = preempted
    summary.update({k.replace("/", "_"): v for k, v in stepper.guard.metrics().items()})  # guard_skipped_steps, ...
    log.finish(summary)
    # After Ctrl-C the ranks end as if done (exit 0): torchrun neither restarts nor reports them.
    return EXIT_PREEMPTED if preempted and not job.preemption.interrupted else 0


def summarize(
    job: Job, history: list[dict], steps_run: int, digest: bool = False, skipped_steps: int | None = None
) -> dict:
    """Final figures (rank 0's view), every rank's start-up figures and, with `digest`
    (debug.final_digest, and never when the job is being stopped: reading every weight
    would eat the grace period; the checkpoint's manifest holds digests), a digest of each
    rank's weights."""
    gathered: list = [None] * job.world_size  # one collective: (digest, start-up figures) of every rank
    dist.all_gather_object(gathered, (weights_digest(job.engine) if digest else None, job.startup))
    digests, startups = [g[0] for g in gathered], [g[1] for g in gathered]
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
        "mfu": _mean(steady, "mfu") if all("mfu" in h for h in steady) else None,  # only against a known peak
        "data_wait_frac": _mean(steady, "data_wait_frac"),
        "peak_mem_bytes": max((h["mem/peak_bytes"] for h in history), default=0),
        "model_state_bytes": history[-1]["mem/model_state_bytes"] if history else 0,
        "model_state_where": job.engine.state_bytes().where,  # params/grads/optim: device or cpu (offload)
        "world_size": job.world_size,
        "weights_digest_per_rank": digests if digest else None,
    }
    if all(startups):  # per rank, in rank order: launcher.device.startup_peaks
        out["startup"] = {key: [s[key] for s in startups] for key in startups[0]}
    if skipped_steps is not None:  # fp16: steps of this launch the loss scaler skipped on overflow
        out["skipped_steps"] = skipped_steps
    evaluated = [h for h in history if "val/loss" in h]
    if evaluated:  # train.eval_every: the last evaluation's
        out["val_loss"], out["val_step"] = evaluated[-1]["val/loss"], evaluated[-1]["step"]
    if history and "mem/activation_bytes" in history[-1]:
        out["activation_bytes"] = history[-1]["mem/activation_bytes"]
    return out


def _mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows) if rows else float("nan")


def weights_digest(engine) -> str:
    """sha256 of this rank's local parameter bytes, in name order."""
    h = hashlib.sha256()
    for name, p in sorted(engine.model.named_parameters()):
        h.update(name.encode())
        t = local_shard(p.detach())  # a shard: this rank's part
        h.update(t.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

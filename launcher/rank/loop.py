"""The training loop, top to bottom. Every recipe runs through here; the engine decides
how micro-batches become an optimizer step, the loop decides when to log and save."""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import recipes
from launcher import models
from launcher.manifest import step_name, whole
from launcher.models.gpt import counting
from launcher.parallel.context import local_positions
from launcher.parallel.degrees import degrees
from launcher.rank import backoff
from launcher.rank.checkpoint import Checkpointer, write_error, write_failure_cause
from launcher.config import Config, FaultPoint
from launcher.data.read import SourceMeter, build_loader, loss_floor, micro_batch
from launcher.device import host_values, memory_stats, peak_flops, reset_peak_memory, synchronize
from launcher.rank.engine import Engine, StepResult, local_shard, owners_sum
from launcher.planner.memory import ActivationCounter
from launcher.rank.metrics import PackMeter, RankZeroLogger, Throughput
from launcher.exits import CHECKPOINT_FAILED_MARKER, EXIT_CHECKPOINT_FAILED, EXIT_PREEMPTED
from launcher.rank.faults import poisoned, strike
from launcher.rank.guard import LossGuard
from launcher.rank.preempt import Preemption
from launcher.rank.profiler import StepProfiler
from launcher.rank.straggler import Stragglers
from launcher.rank.validation import evaluate, held_out_batches, val_metrics
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


def run(job: Job) -> int:
    """Train to the last step (0), or until a stop signal (EXIT_PREEMPTED)."""
    cfg, engine, device = job.cfg, job.engine, job.device
    global_batch = cfg.train.micro_batch * job.grad_accum * job.dp_size
    tokens_per_step = global_batch * cfg.train.seq_len

    # ------------------------------------------------------------------ resume
    ckpt, start_from = job.checkpointer, job.start_from
    step, samples_seen = 0, 0
    if start_from is not None:
        state = ckpt.load(start_from, engine)
        step, samples_seen = state.step, state.samples_seen

    log = RankZeroLogger(cfg, job.run_dir, job.rank, cfg.train.steps, step)
    if start_from is not None:
        log.print(f"resumed from {start_from} at step {step} ({samples_seen:,} samples seen)")
    log.print(f"{cfg.recipe.name}: {job.world_size} rank(s) on {device.type}, global batch {global_batch} "
              f"({cfg.train.micro_batch} x {job.grad_accum} accum x {job.dp_size} dp), {tokens_per_step:,} tokens/step")
    d = degrees(cfg, job.world_size)
    cp, cp_rank = d.cp, d.cp_rank(job.rank)  # parallel.cp: this rank's T/cp positions of each sample
    if job.dp_size != job.world_size or recipes.spec(cfg.recipe.strategy).meshed:
        log.print(f"mesh: pp {d.pp} x dp_replicate {d.dp_replicate} x dp_shard {d.dp_shard} x cp {d.cp} x tp {d.tp}")
    if cfg.precision.fp8:
        n = sum(type(m).__name__ == "Float8Linear" for m in engine.model.modules())
        log.print(f"precision=fp8: {n} linear layers in float8 (torchao, rowwise scales"
                  f"{'; emulated' if cfg.precision.fp8_emulate else ''}), the rest in bf16")

    loader = build_loader(cfg, job.dataset, samples_seen, global_batch, job.dp_rank, job.dp_size, device)
    batches = iter(loader)
    held_out = held_out_batches(job, cp, cp_rank) if cfg.train.eval_every else []
    peak, guessed = peak_flops(device, job.compute_dtype, cfg.cluster.peak_tflops)
    if guessed:
        log.print(guessed)
    meter = Throughput(tokens_per_step, global_batch, job.flops_per_token, peak and peak * job.world_size)
    reset_peak_memory(device)
    first_step = step

    # ------------------------------------------------------------------ loop
    last = cfg.train.steps
    if cfg.train.stop_at is not None and step < cfg.train.stop_at:
        last = min(last, cfg.train.stop_at)
    elif cfg.train.stop_at is not None:  # command.sh run again, a requeue: the stop is behind
        log.print(f"train.stop_at={cfg.train.stop_at} is behind the checkpoint (step {step}): "
                  f"training on to train.steps={cfg.train.steps}")
    watchdog = Watchdog(cfg.dist.timeout_s, job.rank, job.world_size, job.run_dir).start(step)
    profiler = StepProfiler(cfg.profile, job.run_dir, job.rank, device)
    saved_at, preempted = None, False
    measured: dict[str, int] = {}
    skipped_steps = 0  # fp16: steps the loss scaler skipped on overflow, this launch
    engine.guard = guard = LossGuard(cfg, device, job.dp_size * cp, log.print)  # train.max_bad_steps: the engines ask it
    stragglers = Stragglers(cfg, engine, device, job.rank, job.world_size, log.print)  # train.straggler_factor
    drawn = SourceMeter(job.dataset, samples_seen, log.print)  # data/<source>/tokens, epochs run out
    packing = PackMeter(job.dataset, samples_seen, job.world_size // job.dp_size, job.preemption.group)
    job.preemption.started(step)
    while step < last:
        strike(cfg.debug, FaultPoint.hang, step + 1, job.rank)
        profiler.begin(step + 1)
        t0 = time.perf_counter()
        micro_batches = []
        for _ in range(job.grad_accum):
            batch = next(batches)
            packing.count(batch)  # data=chat: the targets it counts, on the host
            mb = micro_batch(batch.to(device, non_blocking=True), cfg.data.document_masking)
            micro_batches.append(tuple(local_positions(t, cp_rank, cp) for t in mb) if cp > 1 else mb)
        # data=chat: each loss divides by the step's counted targets (all ranks), not its own
        counted = packing.step_counted() if cp == 1 else None
        meter.data_wait += (fetched := time.perf_counter() - t0)
        logged = ((step + 1) % cfg.logger.log_every == 0 or step + 1 == last
                  or bool(cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0))
        watchdog.in_step()
        strike(cfg.debug, FaultPoint.hang_in_step, step + 1, job.rank)

        while True:  # once, or again with smaller micro-batches after an out-of-memory (train.oom_backoff)
            try:
                guard.step = step + 1
                with (backoff.injected(job, step + 1, engine.model), poisoned(cfg.debug, step + 1, job.rank, engine.output_module),
                      stragglers.timed(logged, fetched), counting(per_call(counted, job, len(micro_batches)))):
                    # The second step of a launch: the first also holds one-time work (a
                    # pipeline's shape inference); the planner predicts the steady state.
                    if cfg.train.measure_activations and step == min(first_step + 1, last - 1):
                        with ActivationCounter(engine.model) as counter:
                            result = engine.train_step(micro_batches)
                        measured = {"mem/activation_bytes": counter.bytes, **models.offloaded(engine.model)}
                    else:
                        result = engine.train_step(micro_batches)
                break
            except RuntimeError as err:  # torch.OutOfMemoryError is a RuntimeError
                if not backoff.is_out_of_memory(err):
                    raise
                if not backoff.can_retry(job, engine):
                    backoff.record(job, step + 1, err)  # the launcher backs off, or says why not
                    raise
                why = backoff.first_line(err)
            backoff.retry(job, engine, step + 1, why, log)
            micro_batches = backoff.split(micro_batches, cfg.train.micro_batch)
            loader = build_loader(cfg, job.dataset, samples_seen + global_batch, global_batch, job.dp_rank,
                                  job.dp_size, device)  # this step's samples are in hand: from the next one
            batches = iter(loader)
        step += 1
        skipped_steps = skipped_steps + result.skipped  # a device tensor stays one: read when logged
        profiler.end(step)
        if step == first_step + 1 and ckpt.saver is not None:
            # After the first step, when the optimizer's state exists (staging it before
            # would have DCP initialise it with a step of its own); out of the step times.
            warmed = ckpt.saver.warm(engine)
            log.print(f"checkpoint.async_save: {warmed[0] / 2**20:,.0f} MiB of host memory staged in "
                      f"{warmed[1]:.1f} s on rank 0 (each save copies into it, then writes in the background)")
            meter.start += warmed[1]
        samples_seen += global_batch
        meter.steps += 1
        watchdog.progress(step)

        val = None  # train.eval_every: the held-out loss, on every rank (its forwards may hold collectives)
        if cfg.train.eval_every and (step % cfg.train.eval_every == 0 or step == last):
            synchronize(device)  # the step's kernels end before the evaluation's clock starts
            t_eval = time.perf_counter()
            with watchdog.paused():  # a large train.eval_samples may outlast dist.timeout_s
                val = evaluate(job, held_out, device)
                synchronize(device)
            meter.start += time.perf_counter() - t_eval  # out of the step times
        if logged:  # val is not None only on a logged step
            loss = reduced_loss(result, device)
            scaled = result.loss_scale is not None
            # One host synchronisation for every scalar, before the rates (it waits for the device).
            read = host_values(device, loss, result.grad_norm, *((result.loss_scale, skipped_steps) if scaled else ()),
                               *(val.values() if val is not None else ()))
            metrics = {"step": step, "loss": read[0] / (job.dp_size * cp), "lr": engine.lr(),
                       "grad_norm": read[1], **meter.rates(), **memory_stats(device),
                       **engine.state_bytes().as_metrics(), **measured, **guard.metrics(),
                       **stragglers.report(step), **drawn.metrics(step, samples_seen), **packing.metrics(samples_seen)}
            if scaled:
                metrics["loss_scale"] = read[2]
                metrics["skipped_steps"] = int(read[3])
            if val is not None:
                metrics |= val_metrics(dict(zip(val, read[-len(val):])), job.dp_size * cp)
            log.log(metrics)

        if ckpt.saver is not None and not settle(ckpt, watchdog, job, log, block=False):
            return EXIT_CHECKPOINT_FAILED  # an async save failed in the background
        if guard.due():  # train.max_bad_steps in a row: back to the newest checkpoint
            if not settle(ckpt, watchdog, job, log):
                return EXIT_CHECKPOINT_FAILED
            stop = guard.roll_back(engine, ckpt, watchdog.paused)
            if stop is not None:
                print(stop, file=sys.stderr, flush=True)
                watchdog.stop()
                return 1
        every = cfg.checkpoint.every
        stopping_early = step == last < cfg.train.steps
        if (every and step % every == 0) or stopping_early or (step == last and cfg.checkpoint.save_final):
            saved_at = save(ckpt, step, samples_seen, engine, watchdog, job, log)
            if saved_at is None:
                return EXIT_CHECKPOINT_FAILED
            meter.start = time.perf_counter()  # keep save time out of the step time

        if job.preemption.requested(step):  # every rank agrees, so all stop after this step
            if saved_at is None or saved_at.name != step_name(step):
                saved_at = save(ckpt, step, samples_seen, engine, watchdog, job, log)
                if saved_at is None:
                    return EXIT_CHECKPOINT_FAILED
            if not settle(ckpt, watchdog, job, log):  # the marker names a published checkpoint
                return EXIT_CHECKPOINT_FAILED
            if job.rank == 0:
                job.preemption.write_marker(job.run_dir, step, saved_at)
            # No rank leaves before the marker exists: under Slurm the first node to exit
            # starts the end of the whole step, and the job reads the marker to requeue.
            dist.barrier()
            log.print(f"{'Ctrl-C' if job.preemption.interrupted else 'stop signal'}: saved {saved_at} after step {step}; "
                      f"exiting as {'interrupted' if job.preemption.interrupted else 'preempted'}")
            preempted = True
            break

    # ------------------------------------------------------------------ summary
    if not settle(ckpt, watchdog, job, log):  # the last async save, published before the run ends
        return EXIT_CHECKPOINT_FAILED
    watchdog.stop()
    profiler.finish()  # stopped inside the window (preempted, train.stop_at): keep what was recorded
    summary = summarize(job, log.history, step - first_step, digest=cfg.debug.final_digest and not preempted,
                        skipped_steps=int(skipped_steps) if cfg.precision.name.value == "fp16" else None)
    summary["preempted"] = preempted
    summary.update({k.replace("/", "_"): v for k, v in guard.metrics().items()})  # guard_skipped_steps, guard_rollbacks
    log.finish(summary)
    # After Ctrl-C the ranks end as if done (exit 0): torchrun neither restarts nor reports them.
    return EXIT_PREEMPTED if preempted and not job.preemption.interrupted else 0


def per_call(counted: int | None, job: Job, calls: int) -> float | None:
    """What each of a step's loss calls divides by (launcher/models/gpt.py::COUNTED): the
    step's counted targets over the data-parallel ranks and this rank's loss calls (its
    micro-batches, or a pipeline's own), so the step's gradient is the mean over every
    counted token. None where the data counts every target."""
    if counted is None:
        return None
    p = job.cfg.parallel
    return counted / (job.dp_size * (p.pp_microbatches if p.pp > 1 else calls))


def reduced_loss(result: StepResult, device: torch.device) -> torch.Tensor:
    """A step's or an evaluation's loss summed over its owners (engine.owners_sum)."""
    return owners_sum(result.loss, result.loss_owner, device)


def save(ckpt: Checkpointer, step: int, samples_seen: int, engine, watchdog: Watchdog, job: Job,
         log: RankZeroLogger) -> Path | None:
    """A checkpoint (with checkpoint.async_save: staged, and written in the background), or
    None when it could not be written (disk full, folder gone): `failed`."""
    if not settle(ckpt, watchdog, job, log):  # the save before it, if still in flight
        return None
    try:
        with watchdog.paused():
            saved = ckpt.save(step, samples_seen, engine)
    except BaseException as err:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        return failed(err, step, ckpt, watchdog, job)
    t = ckpt.timing
    if ckpt.saver is None:
        log.print(f"checkpoint {saved} (write {t['write_s']:.1f} s, digests {t['digests_s']:.1f} s, "
                  f"publish {t['publish_s']:.1f} s)")
    else:
        log.print(f"checkpoint {saved}: staged in {t['stage_s']:.1f} s, writing in the background")
    return saved


def settle(ckpt: Checkpointer, watchdog: Watchdog, job: Job, log: RankZeroLogger, block: bool = True) -> bool:
    """The async save in flight, if any: wait for it (`block`) or only look whether it is
    done; rank 0 says when it is published. False when it failed (`failed` said why)."""
    saver = ckpt.saver
    if saver is None or saver.pending is None:
        return True
    step = saver.pending[0]
    try:
        with watchdog.paused() if block else contextlib.nullcontext():
            finished = saver.wait() if block else saver.done()
    except BaseException as err:  # noqa: BLE001 - as in save()
        failed(err, step, ckpt, watchdog, job)
        return False
    if finished is not None:
        t = ckpt.timing
        log.print(f"checkpoint {ckpt.root / step_name(finished)} written in the background (write {t['write_s']:.1f} s, "
                  f"digests {t['digests_s']:.1f} s, publish {t['publish_s']:.1f} s)")
    return True


def failed(err: BaseException, step: int, ckpt: Checkpointer, watchdog: Watchdog, job: Job) -> None:
    """A save that could not be written: the rank says so, leaves
    RUN_DIR/checkpoint_failed.json, and the run stops; the last complete checkpoint stays as
    it was. Anything but a failed write is raised as it is."""
    write = write_error(err)
    if write is None:
        raise err
    cause = write_failure_cause(write, ckpt.root)
    last = (whole(ckpt.root, ckpt.run_id) or [None])[-1]
    message = (f"checkpoint at step {step} could not be written on rank {job.rank}: {cause}; stopping. "
               + (f"The last complete checkpoint, {last}, is untouched." if last else
                  "No complete checkpoint was written before it, so there is nothing to resume."))
    print(message, file=sys.stderr, flush=True)
    ckpt.discard_partial(step)
    try:  # the launcher reads it; on a full disk it may stay empty, and the launcher copes
        (job.run_dir / CHECKPOINT_FAILED_MARKER).write_text(
            json.dumps({"message": message, "cause": cause, "step": step}) + "\n")
    except OSError:
        pass  # the run directory may be on the same full disk: the message above stands
    watchdog.stop()
    return None


def summarize(job: Job, history: list[dict], steps_run: int, digest: bool = False,
              skipped_steps: int | None = None) -> dict:
    """Final figures (rank 0's view), every rank's start-up figures and, with `digest`
    (debug.final_digest, and never when the job is being stopped: reading every weight
    would eat the grace period; the checkpoint's manifest holds digests), a digest of each
    rank's weights."""
    gathered = [None] * job.world_size  # one collective: (digest, start-up figures) of every rank
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

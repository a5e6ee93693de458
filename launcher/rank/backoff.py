"""train.oom_backoff on the rank: a step that runs out of memory is retried in place with
the next smaller micro-batch and the accumulation that keeps the global batch, where the
engine can drop a half-done step (one rank: a peer would be waiting inside a collective of
the failed step; an engine that can discard it: ddp). Elsewhere the rank leaves
RUN_DIR/oom.json and the launcher launches again from the last checkpoint with that
micro-batch (launcher/launch/cli.py::supervise_with_backoff)."""

from __future__ import annotations

import gc
import json
from collections.abc import Callable

import torch

from launcher import config as C
from launcher.exits import OOM_MARKER
from launcher.parallel.degrees import back_off, backed_off


def is_out_of_memory(err: BaseException) -> bool:
    """CUDA (torch.OutOfMemoryError) or a failed host allocation."""
    text = str(err)
    return isinstance(err, torch.OutOfMemoryError) or " out of memory" in text or "can't allocate memory" in text


def stepped(job, step: int, micro_batches: list, attempt: Callable, restart: Callable, log):
    """`attempt(micro_batches)`, the step, once; after running out of memory, where this
    rank backs off in place (`can_retry`), again with the smaller micro-batch (`restart`:
    the loader from the next step's samples, this step's being in hand). Elsewhere the
    rank leaves RUN_DIR/oom.json for the launcher and raises."""
    while True:
        try:
            return attempt(micro_batches)
        except RuntimeError as err:  # torch.OutOfMemoryError is a RuntimeError
            if not is_out_of_memory(err):
                raise
            if not can_retry(job, job.engine):
                record(job, step, err)  # the launcher backs off, or says why not
                raise
            why = first_line(err)
        retry(job, job.engine, step, why, log)
        micro_batches = split(micro_batches, job.cfg.train.micro_batch)
        restart()


def can_retry(job, engine) -> bool:
    """Whether this rank backs off in place: train.oom_backoff, no peer (one rank's failure
    leaves the others inside a collective of the step), an engine that can drop a half-done
    step (`Engine.can_discard_step`: not after its optimizer step began, when some
    parameters may have moved), and a smaller micro-batch left."""
    return (
        job.cfg.train.oom_backoff
        and job.world_size == 1
        and engine.can_discard_step()
        and backed_off(job.cfg.train.micro_batch, job.grad_accum) is not None
    )


def retry(job, engine, step: int, why: str, log) -> None:
    """Back off in place (after `can_retry`, outside the except block, so that the error's
    frames and the activations they hold are gone): the engine drops the failed step, job and
    config take the smaller micro-batch, config.yaml and the W&B config say so."""
    cfg = job.cfg
    engine.discard_step()
    gc.collect()
    if job.device.type == "cuda":
        torch.cuda.empty_cache()
    before = (cfg.train.micro_batch, job.grad_accum)
    job.grad_accum = back_off(cfg, *before)[1]
    C.write_frozen(job.run_dir, cfg)
    log.config_changed(cfg)
    log.print(
        f"out of memory at step {step} with micro-batch {before[0]} x {before[1]} ({why}): retrying the step "
        f"with train.micro_batch={cfg.train.micro_batch}, grad_accum {job.grad_accum} (the global batch kept)"
    )


def first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0][:300] if str(err).strip() else err.__class__.__name__


def split(micro_batches: list, micro_batch: int) -> list:
    """The step's batch (already in hand) cut into micro-batches of `micro_batch`: the same
    sequences in the same order ((inputs, targets) or (inputs, targets, positions))."""
    whole = [torch.cat(part) for part in zip(*micro_batches)]
    return list(zip(*(part.split(micro_batch) for part in whole)))


def record(job, step: int, err: BaseException) -> None:
    """RUN_DIR/oom.json for the launcher: where, and the micro-batch and accumulation it
    had (train.oom_backoff launches again with a smaller one)."""
    (job.run_dir / OOM_MARKER).write_text(
        json.dumps(
            {
                "rank": job.rank,
                "step": step,
                "micro_batch": job.cfg.train.micro_batch,
                "grad_accum": job.grad_accum,
                "error": first_line(err),
            }
        )
        + "\n"
    )

"""Fault injection for the reliability tests (`debug.fault`): a real SIGKILL, a real
endless sleep, a poisoned loss (nan_loss, spike), a slow rank or an out-of-memory error, at
a named point on one rank at one step. A no-op unless configured. The training loop has one
hook, `injected`, around each step; the checkpointer strikes at its save points itself."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

import torch

from launcher.config import DebugConfig, FaultPoint
from launcher.rank.engine import parameter_leaves

STRUCK = "fault_oom_struck"
"""debug.fault=oom strikes once per run directory (this file says it has)."""


def due(debug: DebugConfig | None, point: FaultPoint, step: int, rank: int) -> bool:
    """Whether `debug.fault` names this point, this step and this rank."""
    return debug is not None and debug.fault == point and debug.fault_step == step and debug.fault_rank == rank


@contextlib.contextmanager
def injected(job, step: int):
    """debug.fault in the loop, around step `step` from before its batch is fetched to the
    end of its train_step: `hang` strikes on entry (the watchdog reads the rank as waiting
    for data), `hang_in_step` as the engine's step begins (batch in hand, the watchdog
    reading "step", before the step's first collective), `oom`, `nan_loss`, `spike` and
    `slow` as hooks on the model for the step's forwards."""
    debug, rank, engine = job.cfg.debug, job.rank, job.engine
    if debug is None or debug.fault is None:
        yield
        return
    strike(debug, FaultPoint.hang, step, rank)
    with out_of_memory(job, step, engine.model), poisoned(debug, step, rank, engine.output_module):
        if not due(debug, FaultPoint.hang_in_step, step, rank):
            yield
            return
        own = engine.train_step

        def struck(micro_batches):
            strike(debug, FaultPoint.hang_in_step, step, rank)
            return own(micro_batches)

        engine.train_step = struck  # this step only: the class's own comes back below
        try:
            yield
        finally:
            del engine.train_step


def strike(debug: DebugConfig | None, point: FaultPoint, step: int, rank: int) -> None:
    if not due(debug, point, step, rank):
        return
    print(f"rank {rank}: injected fault {point.value} at step {step}", file=sys.stderr, flush=True)
    if point in (FaultPoint.hang, FaultPoint.hang_in_step):
        while True:
            time.sleep(3600)
    os.kill(os.getpid(), signal.SIGKILL)


POISON = {FaultPoint.nan_loss: float("nan"), FaultPoint.spike: 1000.0}


@contextlib.contextmanager
def poisoned(debug: DebugConfig | None, step: int, rank: int, model):
    """debug.fault=nan_loss|spike: the output of `model` (the loss; a pipeline stage's
    activations or logits) times NaN or 1000 on this rank; slow: the first layer holding
    parameters of `model` sleeps debug.slow_s after each forward on this rank (inside the
    span train.straggler_factor times). At steps fault_step to fault_step + fault_steps - 1."""
    if (
        debug is None
        or debug.fault not in (*POISON, FaultPoint.slow)
        or debug.fault_rank != rank
        or not debug.fault_step <= step < debug.fault_step + debug.fault_steps
    ):
        yield
        return
    print(f"rank {rank}: injected fault {debug.fault.value} at step {step}", file=sys.stderr, flush=True)
    if debug.fault == FaultPoint.slow:
        layer = parameter_leaves(model)[0]
        handle = layer.register_forward_hook(lambda *_: time.sleep(debug.slow_s), prepend=True)
    else:
        factor = POISON[debug.fault]
        handle = model.register_forward_hook(lambda _module, _args, output: output * factor)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def out_of_memory(job, step: int, model):
    """debug.fault=oom: torch.OutOfMemoryError at the end of this rank's first forward of
    `step` (where the logits are made, the usual place), once per run directory."""
    if not due(job.cfg.debug, FaultPoint.oom, step, job.rank):
        yield
        return
    try:
        os.close(os.open(job.run_dir / STRUCK, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:  # struck before this relaunch: the back-off's micro-batch fits
        yield
        return

    def strike(module, args, output):
        handle.remove()
        print(f"rank {job.rank}: injected fault oom at step {step}", file=sys.stderr, flush=True)
        raise torch.OutOfMemoryError(f"injected by debug.fault=oom (micro-batch {job.cfg.train.micro_batch})")

    handle = model.register_forward_hook(strike)
    try:
        yield
    finally:
        handle.remove()

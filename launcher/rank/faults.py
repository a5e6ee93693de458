"""Fault injection for the reliability tests (`debug.fault`): a real SIGKILL, a real
endless sleep, a poisoned loss (nan_loss, spike) or a slow rank, at a named point on one rank at one step.
A no-op unless configured."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

from launcher.config import DebugConfig, FaultPoint


def due(debug: DebugConfig | None, point: FaultPoint, step: int, rank: int) -> bool:
    """Whether `debug.fault` names this point, this step and this rank."""
    return debug is not None and debug.fault == point and debug.fault_step == step and debug.fault_rank == rank


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
    if (debug is None or debug.fault not in (*POISON, FaultPoint.slow) or debug.fault_rank != rank
            or not debug.fault_step <= step < debug.fault_step + debug.fault_steps):
        yield
        return
    print(f"rank {rank}: injected fault {debug.fault.value} at step {step}", file=sys.stderr, flush=True)
    if debug.fault == FaultPoint.slow:
        from launcher.rank.engine import parameter_leaves

        layer = parameter_leaves(model)[0]
        handle = layer.register_forward_hook(lambda *_: time.sleep(debug.slow_s), prepend=True)
    else:
        factor = POISON[debug.fault]
        handle = model.register_forward_hook(lambda _module, _args, output: output * factor)
    try:
        yield
    finally:
        handle.remove()

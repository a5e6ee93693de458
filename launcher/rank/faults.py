"""Fault injection for the reliability tests (`debug.fault`): a real SIGKILL, or a real
endless sleep, at a named point on one rank at one step. A no-op unless configured."""

from __future__ import annotations

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

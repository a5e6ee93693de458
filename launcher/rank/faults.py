"""Fault injection for the reliability tests (`debug.fault`): a real SIGKILL, or a real
endless sleep, at a named point on one rank at one step. A no-op unless configured."""

from __future__ import annotations

import os
import signal
import sys
import time

from launcher.config import DebugConfig, FaultPoint


def strike(debug: DebugConfig | None, point: FaultPoint, step: int, rank: int) -> None:
    if debug is None or debug.fault != point or debug.fault_step != step or debug.fault_rank != rank:
        return
    print(f"rank {rank}: injected fault {point.value} at step {step}", file=sys.stderr, flush=True)
    if point in (FaultPoint.hang, FaultPoint.hang_in_step):
        while True:
            time.sleep(3600)
    os.kill(os.getpid(), signal.SIGKILL)

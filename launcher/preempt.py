"""Preemption: SIGTERM or SIGUSR1 (what schedulers send before they stop a job) makes every
rank finish its current step, save a checkpoint and exit with EXIT_PREEMPTED.

Ranks: `Preemption.install()` turns the signals into a flag; after every step the loop
asks `requested()`, which agrees across ranks (a max all-reduce of the flag on a CPU
group, so a GPU job is not synchronised for it): all ranks stop after the same step.
Rank 0 then writes RUN_DIR/preempted.json. The launch side (`supervise`) forwards
signals to torchrun and, when that file appeared during this launch, exits with
EXIT_PREEMPTED instead of torchrun's generic failure code (likewise for the other
markers in launcher/exits.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from launcher.exits import EXIT_PREEMPTED, MARKERS, PREEMPTED_MARKER as MARKER

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    def __init__(self, group=None):
        self.signal: int | None = None
        self.group = group  # a gloo group; None = the default group

    def install(self) -> "Preemption":
        for sig in SIGNALS:
            signal.signal(sig, self._handler)
        return self

    def _handler(self, signum, _frame) -> None:
        self.signal = signum

    def requested(self) -> bool:
        """True on every rank when any rank has received a stop signal."""
        flag = torch.tensor([0 if self.signal is None else int(self.signal)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item() and self.signal is None:
            self.signal = int(flag.item())
        return bool(flag.item())

    def write_marker(self, run_dir: Path, step: int, checkpoint: Path | None) -> None:
        name = signal.Signals(self.signal).name if self.signal else "unknown"
        (run_dir / MARKER).write_text(json.dumps({"step": step, "signal": name, "checkpoint": str(checkpoint),
                                                  "time": time.time()}) + "\n")


def clear_markers(run_dir: Path) -> None:
    for name in MARKERS:
        (run_dir / name).unlink(missing_ok=True)


def supervise(argv: list[str], env: dict[str, str], run_dir: Path, own_group: bool = False,
              drain_s: float = 300) -> int:
    """Run torchrun as a child, forward stop signals to it, map the exit code.

    own_group: the child leads its own process group; signals go to the whole group (the
    ranks included) and, once the child has exited, the ranks still saving are waited for
    (at most drain_s). For a launcher that dies on a signal instead of waiting for its
    ranks (DeepSpeed's)."""
    clear_markers(run_dir)
    proc = subprocess.Popen(argv, env=env, start_new_session=own_group,
                            preexec_fn=functools.partial(stop_with_parent, os.getpid()))

    def send(sig, _frame):
        if own_group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)

    forward = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)
    previous = {sig: signal.signal(sig, send) for sig in forward}
    try:
        rc = proc.wait()
        if own_group:
            _wait_for_group(proc.pid, drain_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if rc == 0:
        return 0
    for name, code in MARKERS.items():
        marker = run_dir / name
        if marker.exists():
            info = json.loads(marker.read_text())
            if code == EXIT_PREEMPTED:
                print(f"preempted by {info['signal']} after step {info['step']}; checkpoint {info['checkpoint']}. "
                      f"Launch the same run directory again to resume.", flush=True)
            else:
                print(info["message"], file=sys.stderr, flush=True)
            return code
    return rc if rc >= 0 else 128 - rc  # killed by a signal: the shell's convention


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None  # looked up before any fork
PR_SET_PDEATHSIG = 1


def stop_with_parent(parent: int) -> None:
    """In the child, before exec: the kernel sends it SIGTERM when the launcher (`parent`)
    dies, by any signal, SIGKILL included (prctl PR_SET_PDEATHSIG). torchrun passes SIGTERM
    to its ranks, which take it as a preemption: finish the step, save, write
    preempted.json and exit. So no rank trains on unsupervised after its launcher is gone.
    Linux only; with cluster.runner=deepspeed the signal reaches DeepSpeed's launcher,
    which exits without waiting for its ranks (as on any signal)."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)


def _wait_for_group(pgid: int, timeout_s: float) -> None:
    """Until no process of the group is left (or timeout_s, then kill what is left)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)

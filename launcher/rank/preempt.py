"""Preemption: SIGTERM or SIGUSR1 (what schedulers send before they stop a job) makes every
rank finish its current step (and the few up to the next agreement), save a checkpoint and
exit with EXIT_PREEMPTED.

Ranks: `Preemption.install()` turns the signals into a flag; after every step the loop
asks `requested(step)`, which agrees across ranks, so all ranks stop after the same step.
The agreement is a max all-reduce of the flag on a CPU group (a GPU job is not
synchronised for it), and only on agreed steps, about every CHECK_S seconds: each check
also reduces the slowest rank's step time, from which every rank computes the same next
check step. A signal is acted on at the first check after it, within about CHECK_S plus a
step; the steps between checks pay nothing. Rank 0 then writes RUN_DIR/preempted.json.
The launch side (`supervise`) forwards signals to torchrun and, when that file appeared
during this launch, exits with EXIT_PREEMPTED instead of torchrun's generic failure code
(likewise for the other markers in launcher/exits.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from launcher import runlock
from launcher.exits import EXIT_INTERRUPTED, EXIT_PREEMPTED
from launcher.exits import PREEMPTED_MARKER as MARKER

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
AGAIN_S = 1.0
"""A second SIGINT this long after the first stop signal stops the rank at once (a repeat
within it is the same Ctrl-C delivered twice)."""
CHECK_S = 1.0
"""About how often the ranks agree on whether to stop (seconds of training between checks)."""


class Preemption:
    def __init__(self, run_dir: Path | None = None, group=None):
        self.signal: int | None = None
        self.since: float | None = None  # when this rank learnt of the stop (time.monotonic)
        self.group = group  # a gloo group; None = the default group
        self.run_dir = run_dir
        self.training = False  # set by the loop before its first step (`started`)
        self.next_check: int | None = None  # the step after which the ranks next agree
        self.checked: tuple[int, float] | None = None  # (step, time.perf_counter()) of the last check

    def install(self, early: tuple[int, ...] | list[int] = ()) -> "Preemption":
        """The handlers; `early`: stop signals recorded before this (launcher/rank/__main__.py::EARLY_STOPS).

        Before the first step a stop signal ends the rank at once (`_stop_before_training`):
        nothing has been trained since the last checkpoint, and a rank blocked in C++
        (joining the process group, loading a checkpoint) would not run a Python handler
        until that call returns, which for a peer that never comes is its timeout. The
        signal module writes each signal's number to a wakeup fd from its C handler; a
        thread reading it acts while the main thread is blocked."""
        for sig in SIGNALS:
            signal.signal(sig, self._handler)
        read, write = os.pipe()
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)

        def woken() -> None:
            while data := os.read(read, 64):
                if not self.training:
                    self._stop_before_training(data[0])

        threading.Thread(target=woken, name="stop-signals", daemon=True).start()
        for early_sig in early:
            self._handler(early_sig, None)
        self.watch_launcher()
        return self

    def started(self, step: int) -> None:
        """The loop is about to run the step after `step`: from now on a stop signal saves.
        The first check is after that step."""
        self.training = True
        self.next_check, self.checked = step + 1, (step, time.perf_counter())

    def _stop_before_training(self, signum: int) -> None:
        """Exit now, as the loop would after a stop (0 after Ctrl-C, EXIT_PREEMPTED after
        a scheduler's signal); rank 0 leaves preempted.json without a step, so the launcher
        explains it and a warned Slurm job requeues."""
        self.signal = signum
        if os.environ.get("RANK", "0") == "0" and self.run_dir is not None:
            with contextlib.suppress(OSError):
                self.write_marker(self.run_dir, None, None)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if signum == signal.SIGINT else EXIT_PREEMPTED)

    def watch_launcher(self) -> None:
        """A rank stops as on SIGTERM (finish the step, save, preempted.json) when the
        launcher that started it dies, by any signal, SIGKILL included. torchrun's ranks
        learn it through torchrun (stop_with_parent) too; DeepSpeed's launcher dies without
        passing anything on, and its per-node launch.py would keep the ranks training
        unsupervised. A pidfd becomes readable when its process ends: a thread waits on it,
        nothing polls. Only where the launcher is visible: this host, this pid namespace."""
        pid = runlock.launcher_of_this_rank()
        if pid is None:
            return
        try:
            fd = os.pidfd_open(pid) if pid else None
        except ProcessLookupError:
            fd = None
        except OSError:  # a kernel without pidfds (before Linux 5.3): torchrun's path still holds
            return
        if fd is None:  # gone before this rank started
            self._handler(signal.SIGTERM, None)
            return

        def wait() -> None:
            select.select([fd], [], [])
            self._handler(signal.SIGTERM, None)

        threading.Thread(target=wait, name="launcher-watch", daemon=True).start()

    def _handler(self, signum, _frame) -> None:
        if not self.training:
            self._stop_before_training(signum)
        if self.signal is None:
            self.signal, self.since = signum, time.monotonic()
        elif signum == signal.SIGINT and time.monotonic() - self.since > AGAIN_S:
            os._exit(EXIT_INTERRUPTED)  # Ctrl-C again: stop now, no save (the last checkpoint stays as it is)

    @property
    def interrupted(self) -> bool:
        """Stopped by Ctrl-C (SIGINT), not by a scheduler's signal."""
        return self.signal == signal.SIGINT

    def requested(self, step: int) -> bool:
        """After `step`: True on every rank when any rank had received a stop signal by the
        last agreed check. Between checks: False at no cost."""
        if step < self.next_check:
            return False
        last_step, last_time = self.checked
        now = time.perf_counter()
        step_us = int(1e6 * (now - last_time) / max(1, step - last_step))
        both = torch.tensor([0 if self.signal is None else int(self.signal), step_us], dtype=torch.int64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        flag, slowest_us = both.tolist()
        if flag and self.signal is None:
            self.signal, self.since = flag, time.monotonic()
        # Every rank has the same `slowest_us`, so every rank picks the same next check.
        self.next_check = step + next_check_in(slowest_us)
        self.checked = (step, now)
        return bool(flag)

    def write_marker(self, run_dir: Path, step: int | None, checkpoint: Path | None) -> None:
        """preempted.json; no step (and no checkpoint) when the stop came before the first step."""
        name = signal.Signals(self.signal).name if self.signal else "unknown"
        (run_dir / MARKER).write_text(
            json.dumps(
                {
                    "step": step,
                    "signal": name,
                    "time": time.time(),
                    "checkpoint": str(checkpoint) if checkpoint else None,
                }
            )
            + "\n"
        )


def next_check_in(step_us: int) -> int:
    """Steps until the next agreement: about CHECK_S of steps of `step_us` microseconds,
    at least 1 (a step slower than CHECK_S: every step) and at most 1000."""
    return max(1, min(1000, int(CHECK_S * 1e6 // max(step_us, 1))))

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
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from launcher import runlock
from launcher.exits import (EXIT_CHECKPOINT_FAILED, EXIT_INTERRUPTED, EXIT_PREEMPTED, MARKERS,
                            PREEMPTED_MARKER as MARKER)

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
AGAIN_S = 1.0
"""A second SIGINT this long after the first stop signal stops the rank at once (a repeat
within it is the same Ctrl-C delivered twice)."""


class Preemption:
    def __init__(self, run_dir: Path | None = None, group=None):
        self.signal: int | None = None
        self.since: float | None = None  # when this rank learnt of the stop (time.monotonic)
        self.group = group  # a gloo group; None = the default group
        self.run_dir = run_dir
        self.training = False  # set by the loop before its first step (`started`)

    def install(self, early: list[int] = ()) -> "Preemption":
        """The handlers; `early`: stop signals recorded before this (train.EARLY_STOPS).

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
        for sig in early:
            self._handler(sig, None)
        self.watch_launcher()
        return self

    def started(self) -> None:
        """The loop is about to run its first step: from now on a stop signal saves."""
        self.training = True

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

    def requested(self) -> bool:
        """True on every rank when any rank has received a stop signal."""
        flag = torch.tensor([0 if self.signal is None else int(self.signal)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item() and self.signal is None:
            self.signal, self.since = int(flag.item()), time.monotonic()
        return bool(flag.item())

    def write_marker(self, run_dir: Path, step: int | None, checkpoint: Path | None) -> None:
        """preempted.json; no step (and no checkpoint) when the stop came before the first step."""
        name = signal.Signals(self.signal).name if self.signal else "unknown"
        (run_dir / MARKER).write_text(json.dumps({"step": step, "signal": name, "time": time.time(),
                                                  "checkpoint": str(checkpoint) if checkpoint else None}) + "\n")


def clear_markers(run_dir: Path) -> None:
    for name in MARKERS:
        (run_dir / name).unlink(missing_ok=True)


def supervise(argv: list[str], env: dict[str, str], run_dir: Path, own_group: bool = False,
              drain_s: float = 300, ckpt_root: Path | None = None) -> int:
    """Run torchrun as a child, forward stop signals to it, map the exit code.

    torchrun leads its own session, so a Ctrl-C in the terminal reaches the launcher alone:
    it says so in one line and hands SIGINT to the ranks themselves (each leads a session of
    its own under torchrun), each as soon as it takes signals (`listening`: also a Ctrl-C
    before the ranks started), which finish the step, save and exit 0, so torchrun ends
    quietly; a second Ctrl-C kills them at once (stop_now). Other stop signals go to
    torchrun, which passes them on. own_group: the child's whole process group gets every signal and, once
    the child has exited, the ranks still saving are waited for (at most drain_s). For a
    launcher that dies on a signal instead of waiting for its ranks (DeepSpeed's)."""
    clear_markers(run_dir)
    proc: subprocess.Popen | None = None
    early: list[int] = []  # signals that came before torchrun was started: handed on once it is
    interrupts: list[float] = []
    handed: set[int] = set()  # the ranks that have the Ctrl-C

    def hand_over() -> None:
        """The Ctrl-C to each rank as soon as it takes signals (one still starting, or
        started later by a restart), until torchrun ends: a thread, from the first Ctrl-C."""
        while proc.poll() is None:
            for pid in children(proc.pid):
                if pid not in handed and listening(pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGINT)
                    handed.add(pid)
            time.sleep(0.2)

    def send(sig, _frame):
        if proc is None:
            early.append(sig)
            return
        if sig == signal.SIGINT:
            interrupts.append(time.monotonic())
            print("Ctrl-C: the ranks finish this step, save and stop (Ctrl-C again to stop at once)"
                  if len(interrupts) == 1 else "Ctrl-C again: stopping now", file=sys.stderr, flush=True)
        if sig == signal.SIGINT and len(interrupts) > 1:
            stop_now(proc, own_group)
        elif own_group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
        elif sig == signal.SIGINT:  # never to torchrun: it would stop the ranks with tracebacks
            threading.Thread(target=hand_over, name="hand-over-ctrl-c", daemon=True).start()
        else:
            proc.send_signal(sig)  # torchrun passes it on

    forward = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)
    previous = {sig: signal.signal(sig, send) for sig in forward}
    try:
        proc = subprocess.Popen(argv, env=env, start_new_session=True,
                                preexec_fn=functools.partial(stop_with_parent, os.getpid()))
        for sig in early:
            send(sig, None)
        rc = proc.wait()
        if own_group:
            _wait_for_group(proc.pid, drain_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return explain(rc, run_dir, ckpt_root or run_dir / "checkpoints", interrupted=bool(interrupts))


def stop_now(proc: subprocess.Popen, own_group: bool) -> None:
    """Ctrl-C again: SIGKILL for torchrun, then its ranks (or DeepSpeed's whole group). A rank
    stuck inside its step or a collective cannot run a signal handler, and a rank that
    ended first would make its peers and torchrun print pages of tracebacks. A save cut
    short leaves the last complete checkpoint as it is (checkpoint.py writes aside and
    renames)."""
    if own_group:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        return
    ranks = children(proc.pid)
    proc.kill()
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def listening(pid: int) -> bool:
    """The rank `pid` takes stop signals: it runs launcher.train and has a SIGUSR1 handler
    of its own (train.EARLY_STOPS's, then Preemption's; Python installs none by itself).
    Earlier, a SIGINT would end it mid-import with a KeyboardInterrupt traceback, or kill it
    before Python starts (SIGINT's default action)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = int(status.split("SigCgt:", 1)[1].split()[0], 16) if "SigCgt:" in status else 0
    rank = b"launcher.train" in cmdline and b"torch.distributed.run" not in cmdline  # torchrun names the module too
    return rank and bool(caught >> (signal.SIGUSR1 - 1) & 1)


def children(pid: int) -> list[int]:
    """The pids whose parent is `pid` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                out.append(int(entry.name))
    return out


LOW_DISK = 16 * 2**20
"""Less free space than this on the checkpoints' filesystem: a failed run is a full disk."""


def explain(rc: int, run_dir: Path, ckpt_root: Path, interrupted: bool = False) -> int:
    """The exit code that says why the ranks stopped, after one line saying it: from the
    marker a rank left (read whatever state it is in: on a full disk it may be empty), or,
    with no marker but a full disk under the checkpoints, EXIT_CHECKPOINT_FAILED."""
    for name, code in MARKERS.items():
        marker = run_dir / name
        if not marker.exists():
            continue
        try:
            info = json.loads(marker.read_text())
        except (OSError, ValueError):
            info = {}
        if code == EXIT_PREEMPTED:
            by = info.get("signal", "a signal")
            what = "interrupted (Ctrl-C)" if by == "SIGINT" else f"preempted by {by}"
            where = (f"after step {info.get('step', '?')}; checkpoint {info.get('checkpoint', '(see the log)')}"
                     if info.get("step", "?") is not None else f"before the first step; {last_checkpoint(ckpt_root)}")
            print(f"{what} {where}. Launch the same run directory again to resume.", flush=True)
            return EXIT_INTERRUPTED if by == "SIGINT" else code
        if code == EXIT_CHECKPOINT_FAILED:
            print(disk_report(ckpt_root, info.get("cause")), file=sys.stderr, flush=True)
        else:
            print(info.get("message", f"{marker} (unreadable)"), file=sys.stderr, flush=True)
        return code
    if rc == 0:
        return 0
    if interrupted:
        print(f"stopped by a second Ctrl-C before saving; {last_checkpoint(ckpt_root)}. Launch the same run "
              f"directory again to resume from it.", flush=True)
        return EXIT_INTERRUPTED
    if free_bytes(ckpt_root) < LOW_DISK or free_bytes(run_dir) < LOW_DISK:
        print(disk_report(ckpt_root, None), file=sys.stderr, flush=True)
        return EXIT_CHECKPOINT_FAILED
    return rc if rc >= 0 else 128 - rc  # killed by a signal: the shell's convention


def free_bytes(path: Path) -> int:
    """Free space on the filesystem that holds `path` (or its nearest existing parent)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def last_checkpoint(ckpt_root: Path) -> str:
    """'the last complete checkpoint, PATH, is untouched' (or that there is none): from
    directory entries and manifests only, nothing that needs free space or reads weights."""
    from launcher.checkpoint import whole

    done = whole(ckpt_root)
    return f"the last complete checkpoint, {done[-1]}, is untouched" if done else "no complete checkpoint yet"


def disk_report(ckpt_root: Path, cause: str | None) -> str:
    """One line: what failed, the folder, its free space, the last complete checkpoint."""
    free = free_bytes(ckpt_root)
    cause = cause or ("no space left on device" if free < LOW_DISK else "the ranks stopped")
    return (f"error: a checkpoint could not be written in {ckpt_root} ({cause}; "
            f"{free / 2**20:,.1f} MiB free there); {last_checkpoint(ckpt_root)}. Free space (or "
            f"choose another checkpoint.dir), then launch the same run directory again to resume.")


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None  # looked up before any fork
PR_SET_PDEATHSIG = 1


def stop_with_parent(parent: int) -> None:
    """In the child, before exec: the kernel sends it SIGTERM when the launcher (`parent`)
    dies, by any signal, SIGKILL included (prctl PR_SET_PDEATHSIG). torchrun passes SIGTERM
    to its ranks, which take it as a preemption: finish the step, save, write
    preempted.json and exit. So no rank trains on unsupervised after its launcher is gone.
    Linux only; with cluster.runner=deepspeed the signal reaches DeepSpeed's launcher,
    which exits without waiting for its ranks: they watch the launcher themselves
    (Preemption.watch_launcher)."""
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

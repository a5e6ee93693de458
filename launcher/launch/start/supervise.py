"""The launch side's child: torchrun (or DeepSpeed's launcher) supervised. Stop signals are
forwarded (a Ctrl-C handed to the ranks themselves), the child dies with the launcher
(PR_SET_PDEATHSIG), and the exit code says why the ranks stopped, from the marker a rank
left (launcher/exits.py; the ranks' side of a stop is launcher/rank/preempt.py)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from launcher import config as C
from launcher.data.progress import duration
from launcher.exits import EXIT_BAD_INPUT, EXIT_CHECKPOINT_FAILED, EXIT_INTERRUPTED, EXIT_PREEMPTED, MARKERS
from launcher.launch.start.console import LOG, Console, killed
from launcher.manifest import root_of, whole


@contextlib.contextmanager
def interrupts_held():
    """A Ctrl-C inside the block is held until the block ends, then raised
    (KeyboardInterrupt; the launcher says it in one line, exit 130). The launch side imports
    torch, the engines, DeepSpeed and transformers lazily, inside such blocks: a
    KeyboardInterrupt inside an import can be swallowed by a library's bare `except:`, and
    the launch would go on as if nothing had been pressed."""
    pressed: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: pressed.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pressed:
        raise KeyboardInterrupt


def clear_markers(run_dir: Path) -> None:
    for name in MARKERS:
        (run_dir / name).unlink(missing_ok=True)


def supervise(
    argv: list[str],
    env: dict[str, str],
    run_dir: Path,
    own_group: bool = False,
    drain_s: float = 300,
    ckpt_root: Path | None = None,
) -> int:
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
    forwarder = _Forwarder(run_dir, own_group)
    previous = {sig: signal.signal(sig, forwarder.send) for sig in _Forwarder.SIGNALS}
    try:
        # torchrun's stderr (its ranks' too) through the console: the ranks' lines live, torchrun's
        # report and the tracebacks into RUN_DIR/torchrun.log (launch/start/console.py)
        proc = subprocess.Popen(
            argv,
            env=env,
            start_new_session=True,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            preexec_fn=functools.partial(stop_with_parent, os.getpid()),
        )
        console = Console(proc.stderr, run_dir, lambda: children(proc.pid))
        forwarder.started(proc)
        rc = proc.wait()
        if own_group:
            _wait_for_group(proc.pid, drain_s)
        console.join(timeout=drain_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return explain(
        rc, run_dir, ckpt_root or run_dir / "checkpoints", interrupted=bool(forwarder.interrupts), console=console
    )


class _Forwarder:
    """supervise's signal handler: where each stop signal goes (see supervise), and the
    Ctrl-Cs taken so far."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)

    def __init__(self, run_dir: Path, own_group: bool):
        self.run_dir, self.own_group = run_dir, own_group
        self.proc: subprocess.Popen | None = None
        self.early: list[int] = []  # signals that came before torchrun was started: handed on once it is
        self.interrupts: list[float] = []
        self.handed: set[int] = set()  # the ranks that have the Ctrl-C

    def started(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        for sig in self.early:
            self.send(sig, None)

    def hand_over(self) -> None:
        """The Ctrl-C to each rank as soon as it takes signals (one still starting, or
        started later by a restart), until torchrun ends: a thread, from the first Ctrl-C."""
        while self.proc.poll() is None:
            for pid in children(self.proc.pid):
                if pid not in self.handed and listening(pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGINT)
                    self.handed.add(pid)
            time.sleep(0.2)

    def send(self, sig, _frame) -> None:
        proc = self.proc
        if proc is None:
            self.early.append(sig)
            return
        if sig == signal.SIGINT:
            self.interrupts.append(time.monotonic())
            print(
                stop_line(self.run_dir) if len(self.interrupts) == 1 else "Ctrl-C again: stopping now",
                file=sys.stderr,
                flush=True,
            )
        if sig == signal.SIGINT and len(self.interrupts) > 1:
            stop_now(proc, self.own_group)
        elif self.own_group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
        elif sig == signal.SIGINT:  # never to torchrun: it would stop the ranks with tracebacks
            threading.Thread(target=self.hand_over, name="hand-over-ctrl-c", daemon=True).start()
        else:
            proc.send_signal(sig)  # torchrun passes it on


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
    """The rank `pid` takes stop signals: it runs launcher.rank.entry and has a SIGUSR1 handler
    of its own (rank/__main__.py's EARLY_STOPS', then Preemption's; Python installs none by itself).
    Earlier, a SIGINT would end it mid-import with a KeyboardInterrupt traceback, or kill it
    before Python starts (SIGINT's default action)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = int(status.split("SigCgt:", 1)[1].split()[0], 16) if "SigCgt:" in status else 0
    rank = b"launcher.rank" in cmdline and b"torch.distributed.run" not in cmdline  # torchrun names the module too
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
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                out.append(int(entry.name))
    return out


LOW_DISK = 16 * 2**20
"""Less free space than this on the checkpoints' filesystem: a failed run is a full disk."""


def explain(rc: int, run_dir: Path, ckpt_root: Path, interrupted: bool = False, console: Console | None = None) -> int:
    """The exit code that says why the ranks stopped, after one line saying it: from the
    marker a rank left (read whatever state it is in: on a full disk it may be empty), or,
    with no marker but a full disk under the checkpoints, EXIT_CHECKPOINT_FAILED; else from
    torchrun's report (`console`): a rank's own refusal (2), a rank killed by a signal (128 +
    the signal), or what is left, with the first traceback a rank printed."""
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
            where = (
                f"after step {info.get('step', '?')}; checkpoint {info.get('checkpoint', '(see the log)')}. "
                f"Launch the same run directory again to resume."
                if info.get("step", "?") is not None
                else f"before the first step; {relaunch(ckpt_root)}"
            )
            print(f"{what} {where}", flush=True)
            return EXIT_INTERRUPTED if by == "SIGINT" else code
        if code == EXIT_CHECKPOINT_FAILED:
            print(disk_report(ckpt_root, info.get("cause")), file=sys.stderr, flush=True)
        else:
            print(info.get("message", f"{marker} (unreadable)"), file=sys.stderr, flush=True)
        return code
    if rc == 0:
        return 0
    if interrupted:
        print(f"stopped by a second Ctrl-C before saving; {relaunch(ckpt_root)}", flush=True)
        return EXIT_INTERRUPTED
    if free_bytes(ckpt_root) < LOW_DISK or free_bytes(run_dir) < LOW_DISK:
        print(disk_report(ckpt_root, None), file=sys.stderr, flush=True)
        return EXIT_CHECKPOINT_FAILED
    failure = console.failure if console is not None else None
    if failure is not None and failure.exitcode == EXIT_BAD_INPUT:  # the rank said why, in its one line
        return EXIT_BAD_INPUT
    if failure is not None and failure.exitcode is not None and failure.exitcode < 0:
        print(f"{killed(failure, console.memory)}; {relaunch(ckpt_root)}", file=sys.stderr, flush=True)
        return 128 - failure.exitcode
    if console is not None and console.held:
        more = len(console.held) - 1
        print(
            "".join(console.held[0]) + f"error: the ranks failed (torchrun exited {rc}); the first traceback a rank "
            f"printed is above{f' ({more} more)' if more else ''}, torchrun's report in {run_dir / LOG}",
            file=sys.stderr,
            end="\n",
            flush=True,
        )
    return rc if rc >= 0 else 128 - rc  # killed by a signal: the shell's convention


def free_bytes(path: Path) -> int:
    """Free space on the filesystem that holds `path` (or its nearest existing parent)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def relaunch(ckpt_root: Path, first: str | None = None) -> str:
    """What launching the run directory again does: 'the last complete checkpoint, PATH, is
    untouched. Launch ... to resume from it.', or, with none, that it starts the run over
    (nothing to resume); `first`: what to do before. From directory entries and manifests
    only, nothing that needs free space or reads weights."""
    done = whole(ckpt_root)
    then = f"{first}, then launch" if first else "Launch"
    if done:
        return f"the last complete checkpoint, {done[-1]}, is untouched. {then} the same run directory again to resume from it."
    return (
        f"no complete checkpoint was written, so there is nothing to resume. {then} the same run directory "
        f"again to start the run over."
    )


AGREE_S = 1.0
"""About how often the ranks agree on a stop (launcher/rank/preempt.py's CHECK_S; not imported:
it imports torch)."""


def stop_line(run_dir: Path) -> str:
    """The first Ctrl-C's line: how soon the ranks finish their step, from the last step
    time rank 0 logged (a step of minutes is not 'about a second'); none before any."""
    step = last_step_s(run_dir)
    when = (
        ""
        if step is None
        else " (within about a second)"
        if step + AGREE_S < 1.5
        else f" (within about {duration(step + AGREE_S)}: the last step took {duration(step)})"
    )
    return f"Ctrl-C: the ranks finish this step{when}, save and stop (Ctrl-C again to stop at once)"


def last_step_s(run_dir: Path) -> float | None:
    """step_time_s of RUN_DIR/metrics.jsonl's last row (its tail only), None without one."""
    try:
        with open(run_dir / "metrics.jsonl", "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 16384))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        with contextlib.suppress(ValueError, KeyError, TypeError):
            return float(json.loads(line)["step_time_s"])
    return None


def disk_report(ckpt_root: Path, cause: str | None) -> str:
    """One line: what failed, the folder, its free space, the last complete checkpoint."""
    free = free_bytes(ckpt_root)
    cause = cause or ("no space left on device" if free < LOW_DISK else "the ranks stopped")
    return (
        f"error: a checkpoint could not be written in {ckpt_root} ({cause}; "
        f"{free / 2**20:,.1f} MiB free there); {relaunch(ckpt_root, 'Free space (or choose another checkpoint.dir)')}"
    )


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


def main(argv: list[str]) -> int:
    """`python -m launcher.launch.start.supervise RUN_DIR COMMAND...`: RUN_DIR/command.sh's last
    line. The run's command supervised as `launcher train` supervises it (a Ctrl-C: the
    ranks save, one line, exit 130; the other endings explained alike). Reads config.yaml
    for the checkpoint folder and the runner; imports no torch."""
    run_dir = Path(argv[0]).resolve()
    cfg = C.load_frozen(run_dir)
    return supervise(
        argv[1:],
        dict(os.environ),
        run_dir,
        own_group=cfg.cluster.runner == C.Runner.deepspeed,
        drain_s=cfg.cluster.shutdown_timeout_s,
        ckpt_root=root_of(cfg, run_dir),
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

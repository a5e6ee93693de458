"""What torchrun and its ranks write to stderr, sorted on its way to the terminal (no torch).

Every line goes to RUN_DIR/torchrun.log. The terminal gets the ranks' own lines as they come
(warnings, `error:` lines, an injected fault), but not torch's log records (torchrun's
warnings, gloo's C++ ones), not torchrun's ChildFailedError traceback and failure table
(parsed instead: which rank failed first, its exit code or signal), and not the ranks'
tracebacks, which are held: a failure the launcher explains (a marker: 74, 75, 124, 130; a
rank's bad-input refusal, 2; a rank killed by a signal) reaches the user as the launcher's
words alone, the surviving ranks' collateral errors ("Connection reset by peer") in the log
only; a failure it cannot explain shows the first traceback held and where the rest are.

A rank killed by a signal is named with its signal and the likely cause: for SIGKILL, the
host's memory (MemAvailable, sampled twice a second) near its limit in the seconds before
points to the kernel's out-of-memory killer; the rank's own peak resident memory (VmHWM)
is given beside it.
"""

from __future__ import annotations

import contextlib
import re
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

LOG = "torchrun.log"
TORCH_LOG = re.compile(r"^\[?[WIEF]\d{4} \d\d:\d\d:\d\d")  # torch's logger lines: W1124 12:00:00.123 pid file:line]
RULE = re.compile(r"^={20,}$")
PREFIX = re.compile(r"^\[(?:rank|default)\d+\]: ?")  # torchrun's mark on each line of a rank
CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
LOW_MEMORY = 0.05  # MemAvailable below this share of MemTotal: the out-of-memory killer's ground


@dataclass
class Failure:
    """torchrun's root cause (the first rank that failed)."""

    rank: int | None = None
    exitcode: int | None = None
    pid: int | None = None


@dataclass
class Memory:
    """The host's lowest MemAvailable in the last seconds and each rank's peak RSS."""

    total: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=20))  # (time, available bytes)
    peaks: dict[int, int] = field(default_factory=dict)  # pid -> VmHWM bytes


def _meminfo() -> dict[str, int]:
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return {}
    return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in lines) if v.split()}


def _peak(pid: int) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    found = re.search(r"VmHWM:\s+(\d+) kB", status)
    return int(found.group(1)) * 1024 if found else None


class Console:
    """Reads `stream` (torchrun's stderr) on a thread until it ends; `watch` gives the ranks'
    pids for the memory sampler."""

    def __init__(self, stream, run_dir: Path, watch, out=None):
        self.stream, self.out, self.watch = stream, out or sys.stderr, watch
        try:
            self.log = open(run_dir / LOG, "a", buffering=1)
        except OSError:  # a full or read-only disk: the terminal still gets what it would
            self.log = None
        self.held: list[list[str]] = []  # the ranks' tracebacks
        self.failure: Failure | None = None
        self.memory = Memory()
        self._states: dict[str, tuple[str, list[str]]] = {}  # per writer: what its lines are inside
        self._rules: dict[str, int] = {}
        self._done = threading.Event()
        self._threads = [
            threading.Thread(target=self._read, name="torchrun-stderr", daemon=True),
            threading.Thread(target=self._sample, name="host-memory", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def join(self, timeout: float | None = None) -> None:
        """Until torchrun's stderr ends (every rank holding it gone), at most `timeout` s."""
        self._threads[0].join(timeout)
        self._done.set()

    def _read(self) -> None:
        for line in iter(self.stream.readline, ""):
            self._write(line)
            self._take(line)
        self.held += [block for state, block in self._states.values() if state in ("tb", "after")]
        if self.log is not None:
            with contextlib.suppress(OSError):
                self.log.close()

    def _write(self, line: str) -> None:
        """Into torchrun.log while the disk takes it (a full disk is a failure the launcher
        explains: its lines must still come)."""
        if self.log is None:
            return
        try:
            self.log.write(line)
        except OSError:
            with contextlib.suppress(OSError):
                self.log.close()
            self.log = None

    def _sample(self) -> None:
        while not self._done.wait(0.5):
            info = _meminfo()
            if "MemAvailable" in info:
                self.memory.total = info.get("MemTotal", 0)
                self.memory.recent.append((time.monotonic(), info["MemAvailable"]))
            for pid in self.watch():
                peak = _peak(pid)
                if peak is not None:
                    self.memory.peaks[pid] = peak

    def _show(self, line: str) -> None:
        self.out.write(line)
        self.out.flush()

    def _take(self, line: str) -> None:
        """One line through its writer's state (torchrun prefixes each rank's lines with
        `[rankN]:`, so interleaved tracebacks of several ranks are told apart)."""
        found = PREFIX.match(line)
        who, text = (found.group(0), line[found.end() :].rstrip("\n")) if found else ("", line.rstrip("\n"))
        state, block = self._states.get(who, ("pass", []))
        if state == "pass":
            if text.startswith("Traceback (most recent call last):"):
                state, block = "tb", [line]
            elif not TORCH_LOG.match(text):
                self._show(line)
        elif state == "tb":
            block.append(line)
            if text and not text[0].isspace() and not text.startswith("Traceback"):  # the exception's line
                state = "table" if "ChildFailedError" in text else "after"
                self._rules[who] = 0
        elif state == "after":
            if not text.strip() or text.startswith(CHAINED) or text.startswith("Traceback"):
                block.append(line)
                state = "tb" if text.startswith("Traceback") else "after"
            else:
                self.held.append(block)
                self._states[who] = ("pass", [])
                return self._take(line)
        elif state == "table":
            block.append(line)
            self._rules[who] += bool(RULE.match(text.strip()))
            if self._rules[who] == 2:
                self.failure, state, block = root_cause(block), "pass", []
        self._states[who] = (state, block)


def root_cause(report: list[str]) -> Failure:
    """The rank, exit code and pid of torchrun's "Root Cause (first observed failure)"."""
    text = "".join(report)
    text = text[text.find("Root Cause") :] if "Root Cause" in text else text
    rank = re.search(r"rank\s*:\s*(\d+)", text)
    code = re.search(r"exitcode\s*:\s*(-?\d+)(?: \(pid: (\d+)\))?", text)
    return Failure(
        int(rank.group(1)) if rank else None,
        int(code.group(1)) if code else None,
        int(code.group(2)) if code and code.group(2) else None,
    )


def killed(failure: Failure, memory: Memory) -> str:
    """Which rank a signal ended and the likely cause, as the start of one line."""
    try:
        name = signal.Signals(-failure.exitcode).name
    except ValueError:
        name = f"signal {-failure.exitcode}"
    who = f"rank {failure.rank}" + (f" (pid {failure.pid})" if failure.pid else "")
    peak = memory.peaks.get(failure.pid) if failure.pid else None
    mine = f"; its peak resident memory {peak / 2**30:.2f} GiB" if peak else ""
    low = min((a for _, a in memory.recent), default=None)
    host = (
        f"the host had {low / 2**30:.2f} of {memory.total / 2**30:.2f} GiB available in the seconds before"
        if low is not None and memory.total
        else "the host's memory was not sampled"
    )
    if name == "SIGKILL" and low is not None and memory.total and low < LOW_MEMORY * memory.total:
        cause = (
            f"most likely the kernel's out-of-memory killer ({host}{mine}): lower train.micro_batch, or free the host"
        )
    elif name == "SIGKILL":
        cause = f"not for memory, it seems ({host}{mine}): another process or the scheduler killed it"
    elif name in ("SIGSEGV", "SIGBUS", "SIGILL", "SIGABRT"):
        cause = f"a crash in native code (see {LOG} in the run directory){mine}"
    else:
        cause = f"sent by another process{mine}"
    return f"error: {who} was killed by {name}: {cause}"

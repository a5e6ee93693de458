"""The preparation's progress on the console: a rich progress bar on a terminal (input done,
documents/s, tokens/s, the time left by input bytes), a plain line every PLAIN_EVERY
seconds otherwise (a log file, a test's captured output)."""

from __future__ import annotations

import sys
import time
from typing import Any

PLAIN_EVERY = 5.0
"""Seconds between two plain progress lines (stdout not a terminal)."""


def count(n: float) -> str:
    """12,345 -> '12.3k'; for rates and sizes in one short word."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Meter:
    """Counts what the workers report; `total` input bytes, `done` of them before this
    launch (units a previous, interrupted launch finished)."""

    def __init__(self, total: int, done: int = 0, out=None, every: float = PLAIN_EVERY):
        self.total, self.done, self.every = max(1, total), done, every
        self.out = out or sys.stdout
        self.bytes = self.docs = self.tokens = 0
        self.t0 = self.last = time.monotonic()
        self.bar: Any = None
        self.task: Any = None

    def __enter__(self) -> "Meter":
        from rich.console import Console  # local: start-up (rich, 0.4 s)

        console = Console(file=self.out)
        self.t0 = self.last = time.monotonic()
        if console.is_terminal:
            # local: start-up (rich, 0.4 s)
            from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

            self.bar = Progress(
                TextColumn("data"),
                BarColumn(),
                TaskProgressColumn(),
                TextColumn("{task.fields[rates]}"),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=console,
                transient=True,
            )
            self.bar.start()
            self.task = self.bar.add_task("tokenizing", total=self.total, completed=self.done, rates="")
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()

    def add(self, nbytes: int, docs: int, tokens: int) -> None:
        self.bytes += nbytes
        self.docs += docs
        self.tokens += tokens

    def rates(self) -> tuple[float, float, float]:
        """Documents/s, tokens/s, input bytes/s of this launch."""
        elapsed = max(1e-9, time.monotonic() - self.t0)
        return self.docs / elapsed, self.tokens / elapsed, self.bytes / elapsed

    def show(self) -> None:
        docs_s, tokens_s, bytes_s = self.rates()
        if self.bar is not None:
            self.bar.update(
                self.task,
                completed=self.done + self.bytes,
                rates=f"{count(docs_s)} documents/s  {count(tokens_s)} tokens/s",
            )
            return
        now = time.monotonic()
        if now - self.last < self.every:
            return
        self.last = now
        left = self.total - self.done - self.bytes
        eta = duration(left / bytes_s) if bytes_s > 0 else "?"
        print(
            f"data: {100 * (self.done + self.bytes) / self.total:.0f}% of {count(self.total)}B, "
            f"{count(docs_s)} documents/s, {count(tokens_s)} tokens/s, ETA {eta}",
            file=self.out,
            flush=True,
        )

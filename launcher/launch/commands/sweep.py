"""A sweep's points (`make train ARGS="-m optim.lr=1e-3,3e-3"`): each named by the values
swept for it (its run name: W&B's and the summary's, unless run_name is given), and, once
every point has run, one table comparing them from their RUN_DIR/summary.json."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.table import Table  # rich: only to print the table


def point_names(points: list[list[str]]) -> list[str]:
    """Each point's overrides that are not the same in every point ('optim.lr=0.001
    model=gpt_small'); '' for all of a sweep of one point."""
    common = set.intersection(*(set(p) for p in points)) if points else set()
    return [" ".join(o for o in p if o not in common) for p in points]


@dataclass
class Point:
    name: str
    run_dir: Path
    rc: int | None = None
    """The launch's exit code; None: nothing was launched (nothing left to train)."""
    started: float = 0.0
    """When its launch began (time.time()): a summary.json older than that is an earlier launch's."""

    def summary(self) -> dict | None:
        path = self.run_dir / "summary.json"
        try:
            if self.rc is not None and path.stat().st_mtime < self.started:
                return None
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None


def comparison(points: list[Point]) -> Table:
    """One row per point: how it ended, its final loss, its last validation loss (a column
    when any point evaluated), tokens/s and rank 0's peak memory."""
    from rich.table import Table  # local: start-up (rich, 0.4 s)

    summaries = [p.summary() for p in points]
    val = any(s and "val_loss" in s for s in summaries)
    t = Table()
    for col in ("point", "run", "exit", "final loss", *(["val loss"] if val else []), "tokens/s", "peak memory"):
        t.add_column(col, justify="left" if col in ("point", "run", "exit") else "right")
    for p, s in zip(points, summaries):
        ended = "nothing to train" if p.rc is None else "ok" if p.rc == 0 else f"exit {p.rc}"
        figures = (
            ["-"] * (4 if val else 3)
            if s is None
            else [
                f"{s['final_loss']:.4f}",
                *([f"{s['val_loss']:.4f}" if "val_loss" in s else "-"] if val else []),
                f"{s['tokens_per_s']:,.0f}",
                f"{s['peak_mem_bytes'] / 2**20:,.0f} MiB",
            ]
        )
        t.add_row(p.name or "-", p.run_dir.name, ended, *figures)
    return t


def print_comparison(points: list[Point]) -> None:
    from rich.console import Console  # local: start-up (rich, 0.4 s)

    print(f"sweep: {len(points)} points in {points[0].run_dir.parent}", flush=True)
    Console(file=sys.stdout, width=160).print(comparison(points))

"""make gpu-check's results, appended to bench/gpu.md as they come.

The check appends one section: its header (the machine, the budget, the cases it will run
and those the budget dropped) when it starts, each case's outcome and measurements when
that case ends, and the cases it skipped at the end. Every write is appended, flushed and
fsynced, and copied to --mirror (the device tool's $OUT) at once: a check stopped by the
clock, killed, or failing half-way leaves everything measured before.

A case's measurements are files in its folder: junit.xml (pytest's outcomes), rounds.json
(scripts/gpu_rounds.py), and measured/*.json from the tests, each {"table": {"title",
"columns", "row"}} plus its raw figures: rows with the same title make one table.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import xml.etree.ElementTree as ET
from pathlib import Path


def gib(n) -> str:
    return f"{n / 2**30:.2f}" if n else "n/a"


def error_line(text: str) -> str:
    """The line that names the failure (the last `SomethingError: ...`), else the last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip() and not set(line.strip()) <= set("=-^")]
    named = [line for line in lines if re.match(r"[\w.]+(Error|Exception)\b", line) or line.startswith("error:")]
    return ((named or lines or ["?"])[-1])[:160].replace("|", "/")


class Report:
    def __init__(self, path: Path, mirror: Path | None = None, extra: tuple[Path, ...] = ()):
        self.path, self.mirror, self.extra = Path(path), mirror, extra
        self.written: list[str] = []
        """This check's section so far (a resumed check appends it again where the file lost it)."""

    def append(self, lines: list[str]) -> None:
        text = "\n".join(lines) + "\n"
        with open(self.path, "a") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        self.written.append(text)
        self.copy()

    def copy(self) -> None:
        if self.mirror is not None:
            self.mirror.mkdir(parents=True, exist_ok=True)
            for p in (self.path, *self.extra):
                if p.exists():
                    shutil.copy2(p, self.mirror / p.name)

    def restore(self, earlier: list[str]) -> None:
        """A resumed check: the earlier calls' part of the section, appended again where the
        file no longer holds it (the device tool copies the working tree afresh each call)."""
        text = self.path.read_text() if self.path.exists() else ""
        missing = [t for t in earlier if t not in text]
        if missing:
            with open(self.path, "a") as f:
                f.write("".join(missing))
        self.written = list(earlier)
        self.copy()

    # ----------------------------------------------------------------- the section's parts
    def start(self, facts: dict, budget: dict, kept: list[dict], dropped: list[dict], resumed: bool) -> None:
        f = facts
        lines = [
            "",
            f"## {f['date']}: `make gpu-check`{' (continued)' if resumed else ''}",
            "",
            f"{f['count']} x {f['gpu']} ({f['memory_gib']} GiB), driver {f['driver']}, CUDA {f['cuda']}, torch "
            f"{f['torch']}, NCCL {f['nccl']}, DeepSpeed {f['deepspeed']}, Python {f['python']}, {f['cpus']} CPU cores.",
            "",
            f"Budget {budget['budget_s']:.0f} s of device time: {budget['install_s']:.0f} s for the install "
            f"({budget['install_source']}), {budget['spent_before_s']:.0f} s spent by earlier calls, "
            f"{budget['cases_s']:.0f} s for the cases. Planned, in this order:",
            "",
        ]
        lines += [f"- `{c['name']}` ({c['part']}): about {c['seconds']:.0f} s ({c['source']})" for c in kept]
        if dropped:
            lines += [
                "",
                "Dropped before starting (lowest priority first, to fit the budget): "
                + ", ".join(f"`{c['name']}` ({c['seconds']:.0f} s)" for c in dropped)
                + ".",
            ]
        self.append(lines)

    def case(self, name: str, what: str, status: str, seconds: float, folder: Path, log_tail: str = "") -> None:
        lines = ["", f"### `{name}`: {status}, {seconds:.0f} s", "", what + "."]
        lines += tests_lines(folder / "junit.xml")
        lines += rounds_lines(folder / "rounds.json")
        lines += table_lines(folder / "measured")
        if status != "passed" and log_tail:
            lines += [
                "",
                "<details><summary>the end of its output</summary>",
                "",
                "```",
                log_tail.rstrip(),
                "```",
                "</details>",
            ]
        self.append(lines)

    def end(self, skipped: list[tuple[str, str]], spent: float, budget: float) -> None:
        lines = ["", f"Spent {spent:.0f} s of the {budget:.0f} s budget (install included)."]
        if skipped:
            lines += ["Not started: " + "; ".join(f"`{n}` ({why})" for n, why in skipped) + "."]
        self.append(lines)


def tests_lines(junit: Path) -> list[str]:
    """pytest's outcomes: a count, a table, and the last lines of each failure."""
    if not junit.exists():
        return []
    rows, tails = [], []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name, outcome, why = case.get("name"), "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[tag]
                why = (node.get("message") or "").splitlines()[0][:200] if node.get("message") else ""
                if tag != "skipped":
                    tails.append((name, "\n".join((node.text or "").strip().splitlines()[-15:])))
        rows.append(f"| {name} | {outcome}{': ' + why.replace('|', '/') if why else ''} |")
    counts = {k: sum(f"| {k}" in r for r in rows) for k in ("passed", "FAILED", "ERROR", "skipped")}
    out = [
        "",
        ", ".join(f"{v} {k.lower()}" for k, v in counts.items() if v) + ".",
        "",
        "| test | outcome |",
        "|---|---|",
        *rows,
    ]
    for name, tail in tails:
        out += ["", f"<details><summary>{name}</summary>", "", "```", tail, "```", "</details>"]
    return out


def rounds_lines(path: Path) -> list[str]:
    if not path.exists():
        return []
    r = json.loads(path.read_text())

    def spread(v, fmt):
        return f"{statistics.median(v):{fmt}} ({min(v):{fmt}}-{max(v):{fmt}})"

    pct = lambda x: f"{100 * x:.1f}%" if x else "n/a"  # noqa: E731
    ok = "met" if r["ratio"] >= r["target"] else "**missed**"
    return [
        "",
        f"{r['rounds']} round(s), seq {r['seq']} x micro-batch {r['micro_batch']}, bf16, {r['gpus']} GPU(s):",
        "",
        "| recipe tokens/s | hand-written tokens/s | ratio, median (min-max) | target | MFU | hand-written MFU | "
        "peak GiB recipe / hand-written |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        f"| {spread(r['recipe_tokens_per_s'], ',.0f')} | {spread(r['baseline_tokens_per_s'], ',.0f')} | "
        f"{spread(r['ratios'], '.3f')} | {r['target']} {ok} | {pct(r['mfu'])} | {pct(r['baseline_mfu'])} | "
        f"{gib(r['peak_bytes'])} / {gib(r['baseline_peak_bytes'])} |",
    ]


def table_lines(folder: Path) -> list[str]:
    """The tests' records with a "table": one markdown table per title, rows in file-name order."""
    tables: dict[str, tuple[list[str], list[list]]] = {}
    for p in sorted(folder.glob("*.json")) if folder.exists() else []:
        t = json.loads(p.read_text()).get("table")
        if t:
            tables.setdefault(t["title"], (t["columns"], []))[1].append(t["row"])
    out = []
    for title, (columns, rows) in tables.items():
        out += ["", title + ":", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out

"""Hang detection: a rank that stops answering ends the job within `dist.timeout_s`, with
a message that names the step and the silent rank.

Each rank runs a daemon thread that publishes the rank's progress (the last step it
finished, and whether it is now waiting for data or inside the next step) to the job's
key-value store every few seconds. When a rank's own loop has made
no progress for `dist.timeout_s`, its thread reads every rank's progress and exits the
process with EXIT_HANG; rank 0 prints which ranks are behind (the silent ones) and
leaves RUN_DIR/hang.json for the launcher. The thread keeps running while the main
thread is stuck in a collective or asleep, so even a silent rank 0 reports.

When every rank is inside the same step, the step cannot tell who holds the others up:
then the heartbeats' collective counts do. torch's flight recorder (dist.flight_recorder,
set in the ranks' environment by the launch side) counts, per process group, the
collectives each rank has entered; a rank that has entered fewer than the others in a
group is the one they wait for (stuck in a kernel, a host call, a deadlock of its own)
and is named. Each rank whose watchdog fires writes its record to RUN_DIR/comm_trace/rank_N,
the format of NCCL's own timeout dump, for torch's analyzer.

Each rank whose watchdog fires writes every thread's Python stack to RUN_DIR/hang/rank<N>.txt
first (faulthandler); rank 0 waits a few heartbeats for the others' and names them.

The process-group timeout is set longer than the watchdog's (see launcher/rank/entry.py), so
this message comes first; the collective's own timeout is the backstop.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from launcher.exits import COMM_TRACE, EXIT_HANG, HANG_MARKER, HANG_STACKS
from launcher.rank.store import job_store


class Watchdog:
    def __init__(self, timeout_s: float, rank: int, world_size: int, run_dir: Path):
        self.timeout_s, self.rank, self.world_size, self.run_dir = timeout_s, rank, world_size, run_dir
        self.interval = max(0.5, min(5.0, timeout_s / 6))
        self.step = 0
        self.phase = "data"  # "data": fetching the next batch; "step": inside train_step
        self.last_progress = time.monotonic()
        self.active = False  # only between steps of the loop: not during start-up or saves
        self.prefix = "launcher/progress/"
        self._store: Any = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="launcher-watchdog", daemon=True)

    # -------------------------------------------------------------------------- main thread
    def start(self, step: int) -> "Watchdog":
        self.step = step
        self._store = job_store_client(self.world_size)
        self._publish(0.0)  # a heartbeat from the start: a rank frozen in its first steps is seen as such
        self._thread.start()
        return self

    def progress(self, step: int) -> None:
        """Called by the loop after every step: cheap (a few assignments)."""
        self.step = step
        self.phase = "data"
        self.last_progress = time.monotonic()
        self.active = True

    def in_step(self) -> None:
        """The batch is here; the rank enters the step (and its collectives)."""
        self.phase = "step"

    @contextmanager
    def paused(self):
        """A checkpoint save may legitimately take longer than a step."""
        self.active = False
        try:
            yield
        finally:
            self.last_progress = time.monotonic()
            self.active = True

    def stop(self) -> None:
        self._stop.set()

    # -------------------------------------------------------------------------- thread
    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            stalled = time.monotonic() - self.last_progress
            self._publish(stalled)
            if self.active and stalled > self.timeout_s:
                self._report_and_exit(stalled)

    def _publish(self, stalled: float) -> None:
        try:
            self._store.set(
                f"{self.prefix}{self.rank}",
                json.dumps(
                    {
                        "step": self.step,
                        "phase": self.phase,
                        "stalled": stalled,
                        "at": time.time(),
                        "collectives": collectives_entered(),
                    }
                ),
            )
        except Exception:  # the store's host may be gone: nothing to publish to
            pass

    def _table(self) -> dict[int, dict]:
        """Every rank's last heartbeat; {"step": None} for a rank that never published one
        (frozen or dead before its first): looked up without waiting, as the store's get()
        would wait its timeout for each such rank, and the collective's backstop would end
        the job first, naming nobody."""
        out = {}
        for r in range(self.world_size):
            try:
                key = f"{self.prefix}{r}"
                out[r] = json.loads(self._store.get(key)) if self._store.check([key]) else {"step": None}
            except Exception:
                out[r] = {"step": None, "stalled": None}
        return out

    def _report_and_exit(self, stalled: float) -> None:
        fired = time.time()
        stacks = write_stacks(self.run_dir, self.rank)  # first: the job may end any moment now
        table = self._table()
        if self.rank in table:  # this rank's own counts, as of now
            table[self.rank]["collectives"] = collectives_entered()
        verdict = diagnose(table, self.step, self.world_size, time.time(), stale_s=3 * self.interval + 5)
        message = f"hang: no progress for {stalled:.0f}s (dist.timeout_s={self.timeout_s:g}) in step {self.step + 1}; {verdict['text']}"
        trace = write_flight_record(self.run_dir, self.rank)
        if self.rank == 0:
            dumped = self._await_stacks(set(range(self.world_size)) - set(verdict["frozen"]), fired)
            if stacks is not None:
                message += (
                    f"; Python stacks of rank(s) {', '.join(map(str, dumped))} in {stacks.parent}/rank<N>.txt"
                    + (
                        f" (none from the stopped rank(s) {', '.join(map(str, verdict['frozen']))})"
                        if verdict["frozen"]
                        else ""
                    )
                )
            print(message, file=sys.stderr, flush=True)
            try:
                (self.run_dir / HANG_MARKER).write_text(
                    json.dumps(
                        {
                            "message": message,
                            "step": self.step + 1,
                            **{k: v for k, v in verdict.items() if k != "text"},
                            "comm_trace": str(trace.parent) if trace else None,
                            "stacks": str(stacks.parent) if stacks else None,
                        }
                    )
                    + "\n"
                )
            except OSError:
                pass
        else:
            print(f"rank {self.rank}: {message}", file=sys.stderr, flush=True)
            # Stay until rank 0 has reported (it waits for the stacks): leaving would close this
            # rank's connections, and rank 0's collective would fail before its report is out.
            deadline = time.monotonic() + 3 * self.interval + 5
            while not _written_since(self.run_dir / HANG_MARKER, fired - 60) and time.monotonic() < deadline:
                time.sleep(0.1)
        os._exit(EXIT_HANG)

    def _await_stacks(self, running: set[int], fired: float) -> list[int]:
        """Rank 0, before it ends the job: the ranks whose stacks are written for this hang,
        waiting (a few heartbeats at most) for those of every rank whose process runs; their
        watchdogs fire within a heartbeat of this one. A file from an earlier hang of the
        run directory (before a resume) is older than that and not counted."""
        deadline, since = time.monotonic() + 3 * self.interval + 2, fired - (3 * self.interval + 5)
        folder = self.run_dir / HANG_STACKS
        while True:
            dumped = sorted(r for r in range(self.world_size) if _written_since(folder / f"rank{r}.txt", since))
            if running <= set(dumped) or time.monotonic() > deadline:
                return dumped
            time.sleep(0.1)


def _written_since(path: Path, since: float) -> bool:
    try:
        return path.stat().st_mtime >= since
    except OSError:
        return False


def write_stacks(run_dir: Path, rank: int) -> Path | None:
    """RUN_DIR/hang/rank<rank>.txt: every thread's Python stack of this process, by
    faulthandler (it reads the frames from C, so a main thread inside a collective or a
    kernel launch shows where it waits). Written whole, then renamed into place."""
    try:
        path = run_dir / HANG_STACKS / f"rank{rank}.txt"
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            f.write(f"rank {rank}, pid {os.getpid()}: the Python stack of every thread when the watchdog fired\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        os.replace(tmp, path)
        return path
    except OSError:  # a diagnosis aid: the hang report goes on without it
        return None


def diagnose(table: dict[int, dict], step: int, world_size: int, now: float, stale_s: float) -> dict:
    """Who holds the job up, from every rank's last heartbeat: `silent` (the ranks named),
    `frozen` (no heartbeat, or a stale one: the process does not run), `behind` (furthest
    behind in steps, or waiting for data while the others are inside the step),
    `behind_in_collectives` (entered fewer collectives of a process group than its other
    members), and `text`, the sentence that says so rank by rank."""
    order = {"data": 0, "step": 1}
    position = {r: (t["step"], order.get(t.get("phase"), 0)) for r, t in table.items() if t["step"] is not None}
    frozen = [r for r, t in table.items() if t["step"] is None or now - t.get("at", 0) > stale_s]
    behind = min(position.values()) if position else (step, 0)
    lagging = [r for r, p in position.items() if p == behind] if len(set(position.values())) > 1 else []
    waiting, short = collective_positions({r: t.get("collectives") for r, t in table.items() if r not in frozen})
    silent = sorted(set(frozen) | set(lagging) | set(short))
    where = {
        r: f"{'waiting for data after' if p[1] == 0 else 'inside the step after'} step {p[0]}"
        for r, p in position.items()
    }
    for r, (group, entered, top) in short.items():
        where[r] += f", has entered {entered} collectives of process group {group}, the others {top}"
    for r, (group, pending) in waiting.items():
        if r not in short:
            where[r] += f", waiting in collective {pending} of process group {group}"
    for r in frozen:  # its process does not run (stopped, swapped out, gone): not merely behind
        where[r] = (
            f"no heartbeat for {now - table[r]['at']:.0f}s (process stopped or gone; last: {where[r]})"
            if r in where
            else "no heartbeat ever (process stopped or gone before its first)"
        )
    who = (
        f"rank(s) {', '.join(map(str, silent))}"
        if silent
        else f"none behind: all {world_size} ranks are stuck inside step {behind[0] + 1}"
    )
    text = f"silent: {who}; " + "; ".join(f"rank {r} {w}" for r, w in sorted(where.items()))
    return {
        "silent": silent,
        "frozen": sorted(frozen),
        "behind": lagging,
        "behind_in_collectives": sorted(short),
        "text": text,
    }


def collective_positions(counts: dict[int, dict | None]) -> tuple[dict[int, tuple], dict[int, tuple]]:
    """From each rank's {process group: [entered, completed]}: the ranks waiting inside a
    collective ({rank: (group, its number)}), and the ranks that entered fewer collectives of
    a group than the group's other members ({rank: (group, entered, the others' most)}).
    Groups are torch's ids, the same on every rank (every rank creates every group, in order);
    a rank reports only its own groups."""
    members: dict[str, dict[int, tuple[int, int]]] = {}
    for r, groups in counts.items():
        for g, (entered, completed) in (groups or {}).items():
            members.setdefault(g, {})[r] = (entered, completed)
    waiting, short = {}, {}
    for g in sorted(members, key=int):
        top = max(e for e, _ in members[g].values())
        for r, (entered, completed) in sorted(members[g].items()):
            if entered < top and r not in short:
                short[r] = (g, entered, top)
            elif entered == top and completed < entered and r not in waiting:
                waiting[r] = (g, entered)
    return waiting, short


def collectives_entered() -> dict[str, list[int]] | None:
    """{process group id: [collectives entered, collectives completed]} on this rank, from
    torch's flight recorder (0.2 ms); None when it is off or this torch has none."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json  # type: ignore[attr-defined]  # local: optional (private torch API)

        status = json.loads(_dump_fr_trace_json(includeCollectives=False)).get("pg_status") or {}
        return {
            g: [int(s["last_enqueued_collective"]), int(s["last_completed_collective"])] for g, s in status.items()
        } or None
    except Exception:  # no recorder in this build, or a format this code does not know
        return None


def write_flight_record(run_dir: Path, rank: int) -> Path | None:
    """RUN_DIR/comm_trace/rank_<rank>: this rank's flight record (its last collectives, with
    their process groups, sizes, states and Python stacks), pickled by torch in the format of
    NCCL's own timeout dump, which `python -m torch.distributed.flight_recorder.fr_trace
    RUN_DIR/comm_trace` reads. Written for the user's tools; the launcher never loads it."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace  # type: ignore[attr-defined]  # local: optional (private torch API)

        if not collectives_entered():
            return None
        path = run_dir / COMM_TRACE / f"rank_{rank}"
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(_dump_fr_trace())
        os.replace(tmp, path)
        return path
    except Exception:  # a diagnosis aid: the hang report goes on without it
        return None


def job_store_client(world_size: int):
    """A connection of this thread's own to the job's store, in this attempt's namespace."""
    return job_store(rank=None, world_size=world_size, timeout_s=30)

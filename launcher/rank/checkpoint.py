"""Checkpoints that survive a kill at any moment (the folder's layout and its checks:
launcher/manifest.py).

A save writes into `step_X.tmp/`, waits for every rank; each rank then hashes and fsyncs
the files it wrote (all ranks at once: `writer_of`), rank 0 gathers the digests into the
manifest, fsyncs the folder's directories, renames the folder to `step_X` and replaces
`latest` (both atomic renames), and deletes all but the newest `keep`. A resume checks the
digests the same way, each rank its share. A crash at any point leaves the previous checkpoint and a
`latest` that names it; a leftover `.tmp` folder is never read and is cleaned up on the
next save. Loading uses `weights_only=True` everywhere.

checkpoint.async_save: the save stops training only while each rank copies its state into
host memory (`Engine.save(path, staging)`, launcher/rank/async_save.py); a writer thread per rank
then writes the files, hashes them and publishes the checkpoint exactly as above, its
collectives on a gloo group of their own. At most one save is in flight: the next save, a
stop and the end of the run wait for it. A kill while it writes leaves a `.tmp` folder,
never read, and the previous checkpoint and `latest` as they were.

Every checkpoint names the run it belongs to (checkpoint.run_id, set by the launcher):
resume=auto takes the newest whole checkpoint of this run, keep-K deletes only this run's.
The launch side sees to it that a folder holds one run's checkpoints (launcher/launch/rundir/identity.py).
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from launcher.config import FaultPoint
from launcher.manifest import (
    TrainerState,
    _fsync_dir,
    belongs,
    complete_checkpoints,
    digests,
    read_latest,
    set_aside,
    step_name,
    step_of,
    verify,
    write_latest,
    write_manifest,
)
from launcher.rank.async_save import Saver
from launcher.rank.faults import strike


def verify_together(folder: Path, rank: int, world: int) -> str | None:
    """verify() by every rank at once, each hashing its share; the same answer on every rank
    (the first problem in rank order). Called on every rank."""
    problems: list[str | None] = [None] * world
    dist.all_gather_object(problems, verify(folder, rank=rank, world=world))
    return next((p for p in problems if p is not None), None)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Checkpointer:
    """Owns CKPT_DIR for one job. Every method is called on every rank."""

    def __init__(
        self,
        root: Path,
        keep: int,
        rank: int,
        world_size: int,
        debug=None,
        run_id: str | None = None,
        about: dict | None = None,
        async_save: bool = False,
        timeout: timedelta | None = None,
    ):
        self.root, self.keep, self.rank, self.world_size = root, keep, rank, world_size
        self.run_id = run_id
        self.about = about  # rank 0: the model that writes (launcher/manifest.py::describe), into every manifest
        self.debug = debug  # fault injection points (launcher/rank/faults.py); None in real runs
        self.timing: dict[str, float] = {}  # the last save's phases, seconds (rank 0's view)
        self.saver = None  # checkpoint.async_save: launcher/rank/async_save.py::Saver, made on every rank
        self.data: str | None = None  # the dataset's fingerprint, saved and compared at resume
        if async_save:
            self.saver = Saver(timeout)

    def _fault(self, point: str, step: int) -> None:
        strike(self.debug, FaultPoint(point), step, self.rank)

    def save(self, step: int, samples_seen: int, engine) -> Path:
        """Write checkpoint `step`; return its final folder. Without async_save it is
        published when this returns; with it, the files are written and the folder published
        in the background (`saver`), and `timing` holds the stall alone."""
        if self.saver is not None:
            self.saver.wait()
        final = self.root / step_name(step)
        tmp = self.root / (step_name(step) + ".tmp")
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob("*.tmp"):
                shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink()
            tmp.mkdir()
            (tmp / "trainer").mkdir()
        dist.barrier()
        t0 = time.perf_counter()
        write = engine.save(tmp / "engine", self.saver)
        trainer = {
            "step": step,
            "samples_seen": samples_seen,
            "world_size": self.world_size,
            "rng": rng_state(),
            "data": self.data,
        }
        mine = tmp / "trainer" / f"rank_{self.rank:05d}.pt"
        if self.saver is None:
            torch.save(trainer, mine)
            dist.barrier()
            self.timing = {"write_s": time.perf_counter() - t0, **self._publish(step, tmp, final, None)}
            return final
        self.timing = {"stage_s": time.perf_counter() - t0}

        def finish() -> None:  # on the writer thread (the RNG states are copies already)
            t0 = time.perf_counter()
            self._fault("save_staged", step)
            if self.debug is not None and self.debug.async_save_delay_s:
                time.sleep(self.debug.async_save_delay_s)
            write()
            torch.save(trainer, mine)
            dist.barrier(group=self.saver.group)  # every rank's files are on disk
            self.timing = {
                **self.timing,
                "write_s": time.perf_counter() - t0,
                **self._publish(step, tmp, final, self.saver.group),
            }

        self.saver.start(step, finish)
        return final

    def _publish(self, step: int, tmp: Path, final: Path, group) -> dict[str, float]:
        """Every rank hashes and fsyncs its files (at once), rank 0 gathers the digests into
        the manifest, renames the folder into place, replaces `latest` and deletes all but the
        newest `keep`. Returns the phases' seconds."""
        t1 = time.perf_counter()
        mine = digests(tmp, self.rank, self.world_size)  # every rank its own files, at once
        known: list[dict] | None = [{}] * self.world_size if self.rank == 0 else None
        dist.gather_object(mine, known, dst=0, group=group)
        t2 = time.perf_counter()
        self._fault("save_engine_written", step)
        if self.rank == 0:
            write_manifest(tmp, step, self.run_id, self.about, {k: v for part in known for k, v in part.items()})
            self._fault("save_manifest_written", step)
            if final.exists():  # a save of the same step from an earlier attempt of this run
                if belongs(final, self.run_id or ""):
                    shutil.rmtree(final)
                else:  # not this run's (or no readable manifest): kept, under another name
                    os.replace(final, final.with_name(f"{final.name}.aside.{int(time.time())}"))
            os.replace(tmp, final)
            _fsync_dir(self.root)
            self._fault("save_renamed", step)
            write_latest(self.root, final.name, self.run_id)
            self._fault("save_latest_written", step)
            for old in self.expired(step):
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier(group=group)
        return {"digests_s": t2 - t1, "publish_s": time.perf_counter() - t2}

    def expired(self, step: int) -> list[Path]:
        """Keep-K after the save of `step` (verified: its digests were just taken): this run's
        checkpoints before it, all but the newest keep - 1. A checkpoint of a later step is not
        this launch's lineage (a resume sets aside the ones failing their digests): never
        counted, never deleted here."""
        older = [f for f in complete_checkpoints(self.root, self.run_id or "") if step_of(f) < step]
        return older[: max(0, len(older) - (self.keep - 1))]

    def discard_partial(self, step: int) -> None:
        """After a failed save: remove its temporary folder (best effort, rank 0)."""
        if self.rank == 0:
            shutil.rmtree(self.root / (step_name(step) + ".tmp"), ignore_errors=True)

    def resolve(self, resume: str) -> Path | None:
        """Which checkpoint to start from, decided by all ranks together (each checks its share
        of the digests; the same answer everywhere): this run's newest whole checkpoint when it has one (a relaunch, a requeue, command.sh run
        again: whatever `resume` said at the run's first start), else what `resume` says."""
        own = self.newest_whole(self.run_id) if self.run_id else None
        if own is not None:
            return own
        if resume == "auto":
            return self.newest_whole(None) if not self.run_id else None
        if resume == "never":
            return None
        problem = verify_together(Path(resume), self.rank, self.world_size)
        if problem is not None:
            raise RuntimeError(f"checkpoint.resume={resume}: {problem}")
        return Path(resume)

    def newest_whole(self, run_id: str | None) -> Path | None:
        """find_latest with every rank checking its share of the digests (the same folders
        on every rank: rank 0 lists them). Newer ones that fail are set aside by rank 0
        (`set_aside`: renamed, never deleted) after `latest` names the one found, so keep-K
        never counts them and `latest` never names a folder that is gone."""
        folders: list[list[str]] = [[str(f) for f in complete_checkpoints(self.root, run_id)] if self.rank == 0 else []]
        dist.broadcast_object_list(folders, src=0)
        failed: list[Path] = []
        found = None
        for folder in map(Path, folders[0][::-1]):
            problem = verify_together(folder, self.rank, self.world_size)
            if problem is None:
                found = folder
                break
            failed.append(folder)
            if self.rank == 0:
                print(f"warning: checkpoint {folder} skipped: {problem}", file=sys.stderr, flush=True)
        if failed and self.rank == 0:
            self.put_aside(failed, found)
        dist.barrier()
        return found

    def put_aside(self, failed: list[Path], found: Path | None) -> None:
        """Rank 0: `latest` to the checkpoint a resume found (or away, when none is left),
        then the failing ones out of the step names, each said in a line."""
        pointer = read_latest(self.root)
        if found is not None:
            write_latest(self.root, found.name, self.run_id)
            self._fault("resume_latest_moved", step_of(found))
        elif pointer is not None and any(pointer[0] == f.name for f in failed):
            (self.root / "latest").unlink()
            _fsync_dir(self.root)
        for folder in failed:
            print(
                f"checkpoint {folder} fails its check: set aside as {set_aside(folder).name} (never resumed or "
                f"deleted by checkpoint.keep)",
                flush=True,
            )

    def load(self, folder: Path, engine) -> TrainerState:
        engine.load(folder / "engine")
        mine = folder / "trainer" / f"rank_{self.rank:05d}.pt"
        if not mine.exists():  # resumed at a larger world size: new ranks take rank 0's
            mine = folder / "trainer" / "rank_00000.pt"
        state = torch.load(mine, map_location="cpu", weights_only=True)
        set_rng_state(state["rng"])
        if self.rank == 0 and state.get("data") != self.data and self.data is not None:
            print(
                f"data: {folder} was saved reading {state.get('data') or 'data whose order it does not record'}; "
                f"this launch reads {self.data}: from sample {int(state['samples_seen']):,} on, the order is not the "
                "one the run trained with (samples may repeat or be skipped)",
                flush=True,
            )
        return TrainerState(step=int(state["step"]), samples_seen=int(state["samples_seen"]), data=state.get("data"))


# ----------------------------------------------------------------------------- a save that failed
def write_failure_cause(err: BaseException, root: Path) -> str:
    """Why a write failed, in words: a full disk says so (torch's zip writer reports it as
    "unexpected pos 64 vs 0"), anything else is the error's first line."""
    from launcher.launch.start.supervise import LOW_DISK, free_bytes  # local: side (rank -> launch)

    free = free_bytes(root)
    if getattr(err, "errno", None) == errno.ENOSPC or "No space left" in str(err) or free < LOW_DISK:
        return f"no space left on device ({free / 2**20:,.1f} MiB free on the filesystem of {root})"
    return str(err).strip().splitlines()[0] if str(err).strip() else err.__class__.__name__


def write_error(err: BaseException) -> BaseException | None:
    """The failed write behind `err`, None if it is something else: `err` itself, or, from
    DCP's CheckpointException (a BaseException that holds each rank's exception), the first
    rank's failed write."""
    failures = getattr(err, "failures", None) if type(err).__name__ == "CheckpointException" else None
    for e in [pair[0] for pair in failures.values()] if isinstance(failures, dict) else [err]:
        if isinstance(e, (OSError, RuntimeError)) and is_write_failure(e):
            return e
    return None


def is_write_failure(err: BaseException) -> bool:
    """A failed file write: an OSError, or torch's zip writer reporting one (it turns a
    full disk into a RuntimeError such as "unexpected pos 64 vs 0")."""
    text = str(err)
    return isinstance(err, OSError) or any(
        s in text
        for s in ("PytorchStreamWriter", "inline_container", "file write failed", "No space left", "unexpected pos")
    )

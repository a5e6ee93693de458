"""Checkpoints that survive a kill at any moment.

    CKPT_DIR/step_00000100/        a complete checkpoint (never written in place)
        engine/                    the recipe's files (engine.save), every rank writes
        trainer/rank_00000.pt      step, data position, RNG states of each rank
        manifest.json              the run id, every file's size and sha256, written last
    CKPT_DIR/latest                the newest complete checkpoint's name (line 1), `run <id>` (line 2)

A save writes into `step_X.tmp/`, waits for every rank; each rank then hashes and fsyncs
the files it wrote (all ranks at once: `writer_of`), rank 0 gathers the digests into the
manifest, fsyncs the folder's directories, renames the folder to `step_X` and replaces
`latest` (both atomic renames), and deletes all but the newest `keep`. A resume checks the
digests the same way, each rank its share. A crash at any point leaves the previous checkpoint and a
`latest` that names it; a leftover `.tmp` folder is never read and is cleaned up on the
next save. Loading uses `weights_only=True` everywhere.

checkpoint.async_save: the save stops training only while each rank copies its state into
host memory (`Engine.save(path, staging)`, launcher/async_save.py); a writer thread per rank
then writes the files, hashes them and publishes the checkpoint exactly as above, its
collectives on a gloo group of their own. At most one save is in flight: the next save, a
stop and the end of the run wait for it. A kill while it writes leaves a `.tmp` folder,
never read, and the previous checkpoint and `latest` as they were.

Every checkpoint names the run it belongs to (checkpoint.run_id, set by the launcher):
resume=auto takes the newest whole checkpoint of this run, keep-K deletes only this run's.
The launch side sees to it that a folder holds one run's checkpoints (launcher/identity.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

STEP_DIR = re.compile(r"^step_(\d{8})$")
MANIFEST = "manifest.json"


@dataclass
class TrainerState:
    step: int
    samples_seen: int


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
        os.fsync(f.fileno())
    return h.hexdigest()


WRITERS = (re.compile(r"(?:^|/)rank_(\d+)\.pt$"),  # trainer/rank_R.pt
           re.compile(r"(?:^|/)__(\d+)_\d+\.distcp$"),  # DCP: each rank's data file
           re.compile(r"zero_pp_rank_(\d+)_"))  # DeepSpeed: each rank's ZeRO partition
"""The rank that writes a checkpoint file, from its name; rank 0 writes the rest (ddp's
model.pt and optim.pt, DCP's .metadata, DeepSpeed's mp_rank_00_model_states.pt)."""


def writer_of(rel: str, world: int) -> int:
    """Which rank hashes (and fsyncs) `rel`: the rank that wrote it, at a smaller world size
    (a resume) that rank modulo the world."""
    for pattern in WRITERS:
        found = pattern.search(rel)
        if found:
            return int(found.group(1)) % world
    return 0


def files_of(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def digests(folder: Path, rank: int, world: int) -> dict[str, dict]:
    """Size and sha256 of the files of `folder` this rank wrote, each fsynced; `by`: the
    rank that hashed it (the manifest's record that the digests were taken in parallel)."""
    return {rel: {"size": (folder / rel).stat().st_size, "sha256": _sha256(folder / rel), "by": rank}
            for rel in files_of(folder) if writer_of(rel, world) == rank}


def write_manifest(folder: Path, step: int, run_id: str | None = None, about: dict | None = None,
                   known: dict[str, dict] | None = None) -> None:
    """folder/manifest.json: the step, the run, `about` (what wrote it: launcher/fit.py), each
    file's size and sha256: from `known` (the ranks' own digests), the rest hashed here. The
    folder's directories are fsynced (their entries are what a rename publishes)."""
    files = dict(known or {})
    for rel in files_of(folder):
        if rel not in files:
            files[rel] = {"size": (folder / rel).stat().st_size, "sha256": _sha256(folder / rel)}
    files = dict(sorted(files.items()))
    for d in sorted({p for p in folder.rglob("*") if p.is_dir()}, key=lambda p: -len(p.parts)):
        _fsync_dir(d)
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"step": step, "run_id": run_id, **(about or {}), "files": files}, indent=1))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)


def verify(folder: Path, checksums: bool = True, rank: int = 0, world: int = 1) -> str | None:
    """None when the checkpoint is whole, else what is wrong with it. With rank and world:
    only the digests of this rank's share (`writer_of`); every name and size is checked."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        return f"no readable manifest ({e.__class__.__name__})"
    for rel, meta in manifest["files"].items():
        checksums_here = checksums and writer_of(rel, world) == rank
        p = folder / rel
        if not p.is_file():
            return f"{rel} is missing"
        if p.stat().st_size != meta["size"]:
            return f"{rel} has {p.stat().st_size} bytes, manifest says {meta['size']}"
        if checksums_here and _sha256(p) != meta["sha256"]:
            return f"{rel} fails its sha256"
    return None


def verify_together(folder: Path, rank: int, world: int) -> str | None:
    """verify() by every rank at once, each hashing its share; the same answer on every rank
    (the first problem in rank order). Called on every rank."""
    problems: list[str | None] = [None] * world
    dist.all_gather_object(problems, verify(folder, rank=rank, world=world))
    return next((p for p in problems if p is not None), None)


def root_of(cfg, run_dir: Path) -> Path:
    """Where a run's checkpoints live: checkpoint.dir, else RUN_DIR/checkpoints."""
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(run_dir) / "checkpoints"


def resumable(cfg, run_dir: Path) -> list[Path]:
    """The checkpoint folders a launch may resume from, oldest first: under resume=auto the
    complete ones whose files match their manifest in name and size, the folder named by
    resume=PATH if it does, none under never. Cheap (no digests: the ranks verify those);
    the launch side checks these before any rank starts."""
    resume = cfg.checkpoint.resume
    if resume == "never":
        return []
    if resume == "auto":
        return whole(root_of(cfg, run_dir))
    folder = Path(resume)
    return [folder] if folder.is_dir() and verify(folder, checksums=False) is None else []


def whole(root: Path, run_id: str | None = None) -> list[Path]:
    """Complete checkpoints (of run `run_id`, if given) whose files match their manifest in
    name and size, oldest first. No digests: quick, and it reads no weights (the launch side
    before a launch, the way out of a run on a full disk)."""
    return [f for f in complete_checkpoints(root, run_id) if verify(f, checksums=False) is None]


def manifest_step(folder: Path) -> int:
    return int(json.loads((folder / MANIFEST).read_text())["step"])


UNREADABLE = object()
"""run_of() of a folder whose manifest cannot be read: no run's (never resumed, never deleted)."""


def run_of(folder: Path):
    """The run id in a checkpoint's manifest: a string, None for a checkpoint written before
    runs had ids (it counts as the run that continues it), UNREADABLE without a manifest."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return UNREADABLE
    return manifest.get("run_id") if isinstance(manifest, dict) else UNREADABLE


def belongs(folder: Path, run_id: str | None) -> bool:
    """Whether the checkpoint is run `run_id`'s (run_id None: any readable one is)."""
    owner = run_of(folder)
    return owner is not UNREADABLE and (run_id is None or owner in (None, run_id))


def read_latest(root: Path) -> tuple[str, str | None] | None:
    """`latest`: the folder name and the run id it records (None in an older pointer)."""
    try:
        lines = (root / "latest").read_text().splitlines()
    except OSError:
        return None
    run = next((line.split(" ", 1)[1].strip() for line in lines[1:] if line.startswith("run ")), None)
    return (lines[0].strip(), run) if lines else None


def complete_checkpoints(root: Path, run_id: str | None = None) -> list[Path]:
    """Renamed (hence finished) checkpoint folders, oldest first; with run_id, only that run's."""
    if not root.is_dir():
        return []
    folders = sorted(p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name))
    return folders if run_id is None else [f for f in folders if belongs(f, run_id)]


def find_latest(root: Path, run_id: str | None = None) -> Path | None:
    """The newest checkpoint (of run `run_id`, if given) that passes its manifest check.
    Only renamed folders count (a save killed before its rename left a .tmp folder, never
    read); one that fails its check is skipped with a warning and the one before it is
    used. The newest complete folder wins even when a kill came between its rename and the
    `latest` update."""
    return first_whole(complete_checkpoints(root, run_id), verify)


def first_whole(folders: list[Path], check, say: bool = True) -> Path | None:
    """The newest of `folders` (oldest first) that `check` passes; each one that fails is
    skipped with a warning (`say`) for the one before it."""
    for folder in folders[::-1]:
        problem = check(folder)
        if problem is None:
            return folder
        if say:
            warnings.warn(f"checkpoint {folder} skipped: {problem}", stacklevel=3)
    return None


def lock_folders(cfg, run_dir: Path) -> list[Path]:
    """What one launch locks (launcher/runlock.py): the run directory and the checkpoint
    folder, also RUN_DIR/checkpoints: a run whose checkpoint.dir names another live run's
    checkpoint folder is refused like a second launch into that run's directory."""
    root = root_of(cfg, run_dir)
    return [run_dir] + ([root] if Path(root).resolve() != Path(run_dir).resolve() else [])


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

    def __init__(self, root: Path, keep: int, rank: int, world_size: int, debug=None, run_id: str | None = None,
                 about: dict | None = None, async_save: bool = False, timeout: timedelta | None = None):
        self.root, self.keep, self.rank, self.world_size = root, keep, rank, world_size
        self.run_id = run_id
        self.about = about  # rank 0: the model that writes (launcher/fit.py::describe), into every manifest
        self.debug = debug  # fault injection points (launcher/faults.py); None in real runs
        self.timing: dict[str, float] = {}  # the last save's phases, seconds (rank 0's view)
        self.saver = None  # checkpoint.async_save: launcher/async_save.py::Saver, made on every rank
        if async_save:
            from launcher.async_save import Saver

            self.saver = Saver(timeout)

    def _fault(self, point: str, step: int) -> None:
        from launcher.config import FaultPoint
        from launcher.faults import strike

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
        trainer = {"step": step, "samples_seen": samples_seen, "world_size": self.world_size, "rng": rng_state()}
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
            self.timing = {**self.timing, "write_s": time.perf_counter() - t0,
                           **self._publish(step, tmp, final, self.saver.group)}

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
            pointer = self.root / "latest.tmp"
            pointer.write_text(final.name + "\n" + (f"run {self.run_id}\n" if self.run_id else ""))
            os.replace(pointer, self.root / "latest")
            _fsync_dir(self.root)
            self._fault("save_latest_written", step)
            for old in complete_checkpoints(self.root, self.run_id or "")[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier(group=group)
        return {"digests_s": t2 - t1, "publish_s": time.perf_counter() - t2}

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
        on every rank: rank 0 lists them)."""
        folders: list[list[str]] = [[str(f) for f in complete_checkpoints(self.root, run_id)] if self.rank == 0 else []]
        dist.broadcast_object_list(folders, src=0)
        return first_whole([Path(f) for f in folders[0]], lambda f: verify_together(f, self.rank, self.world_size),
                           say=self.rank == 0)

    def load(self, folder: Path, engine) -> TrainerState:
        engine.load(folder / "engine")
        mine = folder / "trainer" / f"rank_{self.rank:05d}.pt"
        if not mine.exists():  # resumed at a larger world size: new ranks take rank 0's
            mine = folder / "trainer" / "rank_00000.pt"
        state = torch.load(mine, map_location="cpu", weights_only=True)
        set_rng_state(state["rng"])
        return TrainerState(step=int(state["step"]), samples_seen=int(state["samples_seen"]))

"""What a checkpoint folder holds and how it is checked, read by both sides: step names,
manifest.json, `latest`, which folders are whole and whose run they are, the folders one
launch locks, and what a manifest records about the model. The ranks write checkpoints
(launcher/rank/checkpoint.py, which also describes how a save survives a kill); the
launch side reads them before a launch (identity, fit, the disk check, export). No torch.

    CKPT_DIR/step_00000100/        a complete checkpoint (never written in place)
        engine/                    the recipe's files (engine.save), every rank writes
        trainer/rank_00000.pt      step, data position, RNG states of each rank
        manifest.json              the run id, every file's size and sha256, written last
    CKPT_DIR/latest                the newest complete checkpoint's name (line 1), `run <id>` (line 2)

Every checkpoint names the run it belongs to (checkpoint.run_id, set by the launcher):
resume=auto takes the newest whole checkpoint of this run, keep-K deletes only this run's.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from launcher import models
from launcher.config import to_dict

STEP_DIR = re.compile(r"^step_(\d{8})$")
MANIFEST = "manifest.json"


@dataclass
class TrainerState:
    step: int
    samples_seen: int
    data: str | None = None
    """The data's order at the save (TokenFile.fingerprint); None for synthetic data."""


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


WRITERS = (
    re.compile(r"(?:^|/)rank_(\d+)\.pt$"),  # trainer/rank_R.pt
    re.compile(r"(?:^|/)__(\d+)_\d+\.distcp$"),  # DCP: each rank's data file
    re.compile(r"zero_pp_rank_(\d+)_"),
)  # DeepSpeed: each rank's ZeRO partition
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
    return {
        rel: {"size": (folder / rel).stat().st_size, "sha256": _sha256(folder / rel), "by": rank}
        for rel in files_of(folder)
        if writer_of(rel, world) == rank
    }


def write_manifest(
    folder: Path, step: int, run_id: str | None = None, about: dict | None = None, known: dict[str, dict] | None = None
) -> None:
    """folder/manifest.json: the step, the run, `about` (what wrote it: launcher/launch/checks/fit.py), each
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


def verify(folder: Path, checksums: bool = True, rank: int = 0, world: int = 1, threads: int = 1) -> str | None:
    """None when the checkpoint is whole, else what is wrong with it. With rank and world:
    only the digests of this rank's share (`writer_of`); every name and size is checked.
    `threads`: files hashed at once (hashlib lets go of the GIL: one process reads a
    checkpoint of many files at the disk's speed, not one core's)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        return f"no readable manifest ({e.__class__.__name__})"
    files = manifest["files"]
    for rel, meta in files.items():
        p = folder / rel
        if not p.is_file():
            return f"{rel} is missing"
        if p.stat().st_size != meta["size"]:
            return f"{rel} has {p.stat().st_size} bytes, manifest says {meta['size']}"
    mine = [rel for rel in files if checksums and writer_of(rel, world) == rank]
    with ThreadPoolExecutor(max(1, threads)) as pool:
        for rel, digest in zip(mine, pool.map(lambda rel: _sha256(folder / rel), mine)):
            if digest != files[rel]["sha256"]:
                return f"{rel} fails its sha256"
    return None


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


ASIDE = ".failed"
"""The suffix of a checkpoint set aside because it failed its digests (`step_X.failed`,
`.failed.2`, ...): no step name, so never resumed, counted or deleted by keep-K."""


def set_aside(folder: Path) -> Path:
    """Rename a checkpoint that fails its check out of the step names (kept for a look,
    never deleted); returns its new path."""
    n, dest = 1, folder.with_name(folder.name + ASIDE)
    while dest.exists():
        n += 1
        dest = folder.with_name(f"{folder.name}{ASIDE}.{n}")
    os.rename(folder, dest)
    _fsync_dir(folder.parent)
    return dest


def write_latest(root: Path, name: str, run_id: str | None) -> None:
    """Replace `latest` atomically (fsynced): `name` and the run it records."""
    pointer = root / "latest.tmp"
    pointer.write_text(name + "\n" + (f"run {run_id}\n" if run_id else ""))
    os.replace(pointer, root / "latest")
    _fsync_dir(root)


def step_of(folder: Path) -> int:
    """The step in a checkpoint folder's name (step_00000100 -> 100)."""
    return int(STEP_DIR.match(folder.name).group(1))


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


def shapes(cfg) -> dict[str, list[int]]:
    """The full model's parameters, name -> shape, from its meta-device build (no storage)."""
    return {name: list(p.shape) for name, p in models.on_meta(cfg).named_parameters()}


def describe(cfg) -> dict:
    """What a checkpoint's manifest records about the model that wrote it (the launch side
    compares it with the model a launch builds: launcher/launch/checks/fit.py)."""
    return {"model": to_dict(cfg)["model"], "params": shapes(cfg)}

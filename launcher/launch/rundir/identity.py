"""Run identity: one checkpoint folder holds one run's checkpoints.

Every run has an id (`checkpoint.run_id`, in config.yaml, every manifest and `latest`). The
launch side settles it before any rank starts, under the run directory's lock:

- a launch that continues what the folder holds (resume=auto, or resume= its newest
  checkpoint) keeps that run's id;
- any other launch where checkpoints are (resume=never, resume= an older checkpoint or one
  from elsewhere) would start a second run in the same folder: refused in one line (exit 2),
  or with checkpoint.on_existing=archive the earlier run is moved aside first: the run
  directory's record of it (config.yaml, metrics.jsonl, summary.json, wandb_id, ...) to
  RUN_DIR/archive/<its id>/, its checkpoints to RUN_DIR/archive/<its id>/checkpoints/ (or
  CKPT_DIR/archive/<its id>/ for a checkpoint.dir elsewhere). Nothing is deleted;
- a folder without checkpoints starts a new run with a new id.

The ranks then resume only this run's checkpoints and keep-K deletes only this run's
(launcher/rank/checkpoint.py).
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import time
from pathlib import Path

from launcher import config as C
from launcher import runlock
from launcher.manifest import UNREADABLE, complete_checkpoints, root_of, run_of

RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
ARCHIVE = "archive"
RECORD = (
    "config.yaml",
    "command.sh",
    "ds_config.json",
    "plan.json",
    "metrics.jsonl",
    "summary.json",
    "wandb_id",
    "tensorboard",
    "profile",
    "preempted.json",
    "hang.json",
    "checkpoint_failed.json",
    "oom.json",
)
"""What a run directory keeps of one run, moved beside its checkpoints by an archive."""


def new_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


@dataclasses.dataclass
class Decision:
    run_id: str
    archive: list[Path]
    """The checkpoint folders to move aside first (empty unless on_existing=archive)."""
    old_id: str | None = None


def decide(cfg: C.Config, run_dir: Path) -> Decision:
    """Which run this launch is, and what must be moved aside first; ConfigError (one line,
    exit 2) for a fresh start into another run's folder. Reads manifests only."""
    ck = cfg.checkpoint
    if ck.run_id is not None and not RUN_ID.match(ck.run_id):
        raise C.ConfigError(
            "checkpoint.run_id",
            ck.run_id,
            "letters, digits, '.', '_' and '-' (at most 64), or null for one the launcher makes",
        )
    root = root_of(cfg, run_dir)
    folders = complete_checkpoints(root)
    if not folders:
        return Decision(ck.run_id or new_id(), [])
    owners = [run_of(f) for f in folders]
    held = next((o for o in owners[::-1] if o is not UNREADABLE), None)
    newest = folders[-1]
    continues = ck.resume == "auto" or _same(Path(ck.resume), newest)
    if continues:
        if ck.run_id is not None and held is not None and ck.run_id != held:
            raise C.ConfigError(
                "checkpoint.run_id",
                ck.run_id,
                f"{root} holds run {held}'s checkpoints, which this launch resumes; leave checkpoint.run_id unset",
            )
        return Decision(held or ck.run_id or new_id(), [])
    span = f"{folders[0].name}..{newest.name}" if len(folders) > 1 else newest.name
    who = f"run {held}'s" if held else "a run's"
    if ck.on_existing == C.OnExisting.archive:
        return Decision(ck.run_id or new_id(), folders, held)
    raise C.ConfigError(
        "checkpoint.resume",
        ck.resume,
        f"{root} holds {who} checkpoints ({span}); a fresh start there would mix two runs. Use "
        f"another hydra.run.dir (or checkpoint.dir), checkpoint.resume=auto to continue that run, "
        f"or checkpoint.on_existing=archive to move that run aside (into {run_dir / ARCHIVE}/) first",
    )


def settle(cfg: C.Config, run_dir: Path) -> C.Config:
    """decide(), then move aside what it says (the launch holds the run directory's lock);
    the config the ranks get: checkpoint.run_id set, a resume= path into a moved folder
    followed to where it went."""
    d = decide(cfg, run_dir)
    resume = cfg.checkpoint.resume
    if d.archive:
        moved = archive(root_of(cfg, run_dir), run_dir, d.archive, d.old_id)
        print(
            f"checkpoint.on_existing=archive: the checkpoints of run {d.old_id or '(no id)'} moved to {moved}",
            flush=True,
        )
        source = Path(resume)
        if resume not in ("auto", "never") and any(_same(source, f) for f in d.archive):
            resume = str(moved / source.name)
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, run_id=d.run_id, resume=resume))


def archive(root: Path, run_dir: Path, folders: list[Path], old_id: str | None) -> Path:
    """Move the earlier run aside: its run-directory record to RUN_DIR/archive/<name>/, its
    checkpoints and `latest` to RUN_DIR/archive/<name>/checkpoints/ (or, for a checkpoint.dir
    elsewhere, CKPT_DIR/archive/<name>/). Renames on one filesystem: nothing is copied or
    deleted. Returns where the checkpoints went."""
    if not all(runlock.held_here(f) for f in {root, run_dir} if f.exists()):  # a command that forgot its locks
        raise runlock.Held(
            f"{root}: checkpoints are moved only under the locks of {run_dir} and {root} "
            "(runlock.hold_all(lock_folders(...)))"
        )
    name = old_id or "run-" + time.strftime("%Y%m%d-%H%M%S", time.gmtime(folders[-1].stat().st_mtime))
    own = root == run_dir / "checkpoints"
    home = _fresh(run_dir / ARCHIVE / name, root / ARCHIVE / name)
    dest = home / "checkpoints" if own else root / ARCHIVE / home.name
    dest.mkdir(parents=True)
    for f in [*folders, root / "latest"]:
        if f.exists():
            os.rename(f, dest / f.name)
    for n in RECORD:
        if (run_dir / n).exists():
            home.mkdir(parents=True, exist_ok=True)
            os.rename(run_dir / n, home / n)
    return dest


def _fresh(*paths: Path) -> Path:
    """paths[0], or its .2, .3, ... sibling: the first name free under every path given."""
    n, name = 1, paths[0].name
    while any(p.with_name(name).exists() for p in paths):
        n += 1
        name = f"{paths[0].name}.{n}"
    return paths[0].with_name(name)


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False

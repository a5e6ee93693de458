"""One launch per run directory: `RUN_DIR/.launch.lock` names the launch that owns the
directory (host, pid, the pid's start time, Slurm job) for as long as it runs.

A second launch into the directory is refused at once, naming the holder. A lock is taken
over only when its holder is provably gone: on this host, its pid no longer runs the
process that took it (the kernel's start time of the pid is compared, so a reused pid does
not count as alive); on any host, a requeue of the same Slurm job (a new
SLURM_RESTART_COUNT: Slurm ends the earlier incarnation before it starts the next). Otherwise
(another host, no shared job) nobody can prove it: the line says which file to remove.

The lock file appears whole or not at all: its record is written to a private file, then
hard-linked into place, which fails if the lock exists (atomic on local filesystems and
on NFSv3+, which Slurm clusters share run directories on). A stale lock is taken over by
renaming it to a name only this process uses, checking that what moved is the record
judged gone (else it is put back), then publishing a fresh one.
Released when the launch ends (`with hold(run_dir):`); a launcher killed with SIGKILL
leaves it behind, stale, for the next launch on this host to take over.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path

LOCK = ".launch.lock"


class Held(Exception):
    """The run directory belongs to another live launch (str: one line naming it)."""


def _start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (field 22 of /proc/pid/stat), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()[19]


def me() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _start_time(os.getpid()),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"), "slurm_restart": os.environ.get("SLURM_RESTART_COUNT", "0"),
            "started": time.time()}


def gone(holder: dict) -> bool:
    """The holder provably no longer runs."""
    mine = me()
    if holder.get("slurm_job_id") and holder.get("slurm_job_id") == mine["slurm_job_id"] \
            and holder.get("slurm_restart") != mine["slurm_restart"]:
        return True  # a requeue of the job that held it: Slurm ended the earlier run first
    if holder.get("host") != mine["host"]:
        return False
    return _start_time(int(holder["pid"])) != holder.get("pid_start")


def describe(holder: dict, path: Path) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    job = f", Slurm job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    return (f"{path.parent} is in use by the launch started {when} on {holder.get('host')} (pid {holder.get('pid')}"
            f"{job}); wait for it, stop it, or choose another hydra.run.dir. If that launch is gone for good "
            f"(its host is down), remove {path}")


def _read(path: Path) -> dict | None:
    """The holder recorded in `path`; None if the file is gone, {} if it is not a record."""
    try:
        holder = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) and isinstance(holder.get("pid"), int) else {}


def _publish(path: Path) -> bool:
    """Create `path` holding this launch's record, whole or not at all: the record is
    written to a private file first, then hard-linked into place (fails if it exists)."""
    tmp = path.with_name(f"{LOCK}.{socket.gethostname()}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(me(), f)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def acquire(run_dir: Path) -> Path:
    path = run_dir / LOCK
    run_dir.mkdir(parents=True, exist_ok=True)
    for _ in range(5):
        if _publish(path):
            return path
        holder = _read(path)
        if holder is None:  # released this instant
            continue
        if not holder:
            raise Held(f"{path} is not a lock this launcher wrote; if no launch is running there, remove it")
        if not gone(holder):
            raise Held(describe(holder, path))
        # Move the stale lock aside under a name only this process uses, and check that it
        # is the one judged gone: another launch may have taken it over in between.
        aside = path.with_name(f"{LOCK}.stale.{socket.gethostname()}.{os.getpid()}")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            continue
        if _read(aside) != holder:  # a fresh lock of another launch: put it back
            with contextlib.suppress(OSError):
                os.link(aside, path)
        aside.unlink(missing_ok=True)
    raise Held(f"{path}: could not take the lock (other launches keep taking it)")


def release(path: Path) -> None:
    """Remove the lock if it is still this process's."""
    holder = _read(path)
    if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        with contextlib.suppress(OSError):
            path.unlink()


@contextlib.contextmanager
def hold(run_dir: Path):
    path = acquire(run_dir)
    try:
        yield path
    finally:
        release(path)

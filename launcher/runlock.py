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

Rank 0 holds it too (`rank_hold`, launcher/rank/entry.py) when no launcher does: a Slurm job
(job.sbatch starts torchrun on every node), `RUN_DIR/command.sh` run again, torchrun typed
by hand. Ranks a launcher started carry LAUNCHER_RUN_LOCK (never written to command.sh or
a job): their launch holds the lock (node 0's launcher, when several nodes were started by
hand and rank 0 landed on another node), and rank 0 leaves it be. So a
second launch of any kind into a running run directory is refused, and a Slurm job
requeued or restarted takes its own lock over (a new SLURM_RESTART_COUNT; a job Slurm
reports ended, through squeue, is gone too).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

LOCK = ".launch.lock"
ENV = "LAUNCHER_RUN_LOCK"  # set by a launcher for the ranks it starts: their launch holds the lock
ENDED = {
    "BOOT_FAIL",
    "CANCELLED",
    "COMPLETED",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "TIMEOUT",
}


class Held(Exception):
    """The run directory belongs to another live launch (str: one line naming it)."""


def _start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (field 22 of /proc/pid/stat), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()[19]


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def me() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pid_start": _start_time(os.getpid()),
        "pid_ns": _pid_namespace(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_restart": os.environ.get("SLURM_RESTART_COUNT", "0"),
        "started": time.time(),
    }


def gone(holder: dict) -> bool:
    """The holder provably no longer runs."""
    mine = me()
    job = holder.get("slurm_job_id")
    if job and job == mine["slurm_job_id"] and holder.get("slurm_restart") != mine["slurm_restart"]:
        return True  # a requeue of the job that held it: Slurm ended the earlier run first
    # pids compare within one pid namespace (a container has its own); a record from before
    # the namespace was written counts as this host's
    same_pids = holder.get("host") == mine["host"] and holder.get("pid_ns", mine["pid_ns"]) == mine["pid_ns"]
    if same_pids and _start_time(int(holder["pid"])) != holder.get("pid_start"):
        return True
    return bool(job) and job != mine["slurm_job_id"] and slurm_job_ended(str(job))


def slurm_job_states(job_id: str) -> list[str] | None:
    """What squeue says of the job: its states ([] once Slurm no longer knows it), or None
    when it cannot be asked (no squeue here, no controller)."""
    if shutil.which("squeue") is None:
        return None
    try:
        proc = subprocess.run(
            ["squeue", "--noheader", f"--jobs={job_id}", "--format=%T"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return [] if "Invalid job id" in proc.stderr else None  # purged: it ended long enough ago
    return proc.stdout.split()


def slurm_job_ended(job_id: str) -> bool:
    """Slurm says the job has ended (or no longer knows it); not when it cannot be asked."""
    states = slurm_job_states(job_id)
    return states is not None and all(state in ENDED for state in states)


def check_free(run_dir: Path) -> None:
    """Held (one line) if a live launch holds run_dir, or a Slurm job submitted for it has
    not ended (pending jobs hold no lock yet)."""
    path = run_dir / LOCK
    holder = _read(path)
    if holder and not _mine(holder) and not gone(holder):
        raise Held(describe(holder, path))
    job_file = run_dir / "slurm_job_id"  # launcher/launch/submit/slurm.py::JOB_ID_FILE
    job = job_file.read_text().strip() if job_file.is_file() else ""
    states = slurm_job_states(job) if job.isdigit() else None
    live = [state for state in states or [] if state not in ENDED]
    if live:
        raise Held(
            f"{run_dir} belongs to Slurm job {job} ({live[0]}); wait for it, `scancel {job}`, or choose "
            f"another hydra.run.dir"
        )


def describe(holder: dict, path: Path) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    job = f", Slurm job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    return (
        f"{path.parent} is in use by the launch started {when} on {holder.get('host')} (pid {holder.get('pid')}"
        f"{job}); wait for it, stop it, or choose another hydra.run.dir (checkpoint.dir). If that launch is gone for good "
        f"(its host is down), remove {path}"
    )


def _mine(holder: dict | None) -> bool:
    return bool(holder) and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()


def inside_a_launch() -> bool:
    """This process is a rank its launcher started: the launch holds the run directory."""
    return bool(os.environ.get(ENV))


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
    if _mine(_read(path)):
        with contextlib.suppress(OSError):
            path.unlink()


@contextlib.contextmanager
def hold(run_dir: Path):
    """The lock for the life of the block; a folder made for the lock alone (a checkpoint
    folder nothing was saved in) goes with it."""
    made = not run_dir.exists()
    path = acquire(run_dir)
    try:
        yield path
    finally:
        release(path)
        if made:
            with contextlib.suppress(OSError):
                run_dir.rmdir()  # only if empty


@contextlib.contextmanager
def hold_all(folders: list[Path]):
    """Each folder's lock (launcher/manifest.py::lock_folders: the run directory and the
    checkpoint folder) for the life of the block: what every command that may move, archive
    or delete checkpoints holds (train, submit)."""
    with contextlib.ExitStack() as stack:
        for folder in folders:
            stack.enter_context(hold(folder))
        yield


def held_here(folder: Path) -> bool:
    """This process holds `folder`'s lock (identity.archive moves nothing without it)."""
    return _mine(_read(folder / LOCK))


def for_ranks() -> dict[str, str]:
    """The environment that tells a launcher's ranks their launch holds the lock, and which
    process the launcher is (host, pid, pid namespace: preempt.watch_launcher)."""
    mine = me()
    return {ENV: json.dumps({k: mine[k] for k in ("host", "pid", "pid_start", "pid_ns")})}


def launcher_of_this_rank() -> int | None:
    """The pid of the launcher that started this rank, when it runs on this host in this pid
    namespace (pdsh's ranks on other nodes cannot see it); 0 when it is gone already (its
    pid free or taken by another process); None where it cannot be seen."""
    try:
        record = json.loads(os.environ.get(ENV, ""))
    except ValueError:
        return None
    mine = me()
    if not isinstance(record, dict) or any(record.get(k) != mine[k] for k in ("host", "pid_ns")):
        return None
    pid = record.get("pid")
    if not isinstance(pid, int) or _start_time(pid) != record.get("pid_start"):
        return 0  # already gone (or its pid reused)
    return pid


RANK_WAIT_S = 10.0  # a `launcher submit` holds the lock until sbatch has answered


@contextlib.contextmanager
def rank_hold(folders: list[Path]):
    """Rank 0 started without a launcher: each folder's lock, for the life of the rank. A
    holder that lets go within RANK_WAIT_S (the submit of this very job) is waited for."""
    with contextlib.ExitStack() as stack:
        if not inside_a_launch():
            for folder in folders:
                deadline = time.monotonic() + RANK_WAIT_S
                while True:
                    try:
                        stack.enter_context(hold(folder))
                        break
                    except Held:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.5)
        yield


def main(argv: list[str]) -> int:
    """`python -m launcher.runlock RUN_DIR`: exit 2 with one line if a live launch holds it."""
    try:
        check_free(Path(argv[0]))
    except Held as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

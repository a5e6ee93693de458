"""One launch owns a run directory: a second is refused while the first runs, the ranks of
a launcher killed with SIGKILL stop (saving) instead of training on unsupervised, the next
launch takes the stale lock over, and a relaunch of a finished run changes nothing."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from conftest import FAST, launch, start, wait_for_step
from launcher import runlock


def processes_of(run_dir: Path) -> list[int]:
    """Pids whose command line names the run directory (the launcher, torchrun, the ranks)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if str(run_dir).encode() in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


def test_a_lock_is_taken_over_only_from_a_launch_that_is_gone(tmp_path, monkeypatch):
    path = runlock.acquire(tmp_path)
    holder = json.loads(path.read_text())
    assert holder["pid"] == os.getpid() and not runlock.gone(holder)
    with pytest.raises(runlock.Held, match=f"pid {os.getpid()}"):
        runlock.acquire(tmp_path)
    # A dead pid on this host, or a live pid that now runs another process: gone.
    assert runlock.gone({**holder, "pid": 2**22 + 7})
    assert runlock.gone({**holder, "pid_start": "1"})
    # Another host cannot be checked: held, unless it is a requeue of the same Slurm job.
    assert not runlock.gone({**holder, "host": "other-node.invalid"})
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert runlock.gone({**holder, "host": "other-node.invalid", "slurm_job_id": "77", "slurm_restart": "0"})
    assert not runlock.gone({**holder, "host": "other-node.invalid", "slurm_job_id": "77", "slurm_restart": "1"})
    runlock.release(path)
    assert not path.exists()
    path.write_text(json.dumps({**holder, "pid": 2**22 + 7}))  # left by a launcher killed with SIGKILL
    assert json.loads(runlock.acquire(tmp_path).read_text())["pid"] == os.getpid()
    path.write_text("not a lock")  # nobody can tell who holds this one
    with pytest.raises(runlock.Held, match="not a lock this launcher wrote"):
        runlock.acquire(tmp_path)


@pytest.mark.slow
def test_one_launch_per_run_dir_and_no_orphans_after_sigkill(tmp_path):
    run = tmp_path / "run"
    first = start(run, "cluster.nproc_per_node=2", *FAST, "train.steps=100000", "checkpoint.every=0", "logger=none")
    wait_for_step(run, 3, first)
    config = (run / "config.yaml").read_bytes()

    t0 = time.monotonic()
    second = launch("cluster.nproc_per_node=2", *FAST, "logger=none", run_dir=run, check=False)
    assert second.returncode == 2 and time.monotonic() - t0 < 60, second.stderr[-2000:]
    lines = [line for line in second.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "is in use by the launch" in lines[0] and f"pid {first.pid}" in lines[0], lines
    assert (run / "config.yaml").read_bytes() == config  # the second launch wrote nothing

    os.kill(first.pid, signal.SIGKILL)  # the launcher only: torchrun and the ranks are its children
    first.wait()
    deadline = time.monotonic() + 90
    while processes_of(run) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not processes_of(run), "ranks still running after their launcher was killed"
    marker = json.loads((run / "preempted.json").read_text())  # they stopped as on a preemption: saved
    step = marker["step"]
    assert Path(marker["checkpoint"]).is_dir() and step >= 3

    # The next launch takes the stale lock over and resumes the saved step.
    resumed = launch("cluster.nproc_per_node=2", *FAST, f"train.steps={step + 2}", "logger=none", run_dir=run)
    assert f"at step {step}" in resumed.stdout, resumed.stdout[-2000:]
    assert not (run / runlock.LOCK).exists()
    summary = (run / "summary.json").read_bytes()
    files = sorted(str(p) for p in run.rglob("*"))

    again = launch("cluster.nproc_per_node=2", *FAST, f"train.steps={step + 2}", "logger=none", run_dir=run)
    lines = [line for line in again.stdout.splitlines() if line.strip()]
    assert lines == [f"nothing to train: {run} has a checkpoint at step {step + 2} of train.steps={step + 2}; "
                     f"raise train.steps to train on"], again.stdout
    assert (run / "summary.json").read_bytes() == summary and sorted(str(p) for p in run.rglob("*")) == files

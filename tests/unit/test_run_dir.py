"""The run directory's lock, in process: taken over only from a launch that is gone; rank 0
waits for a holder that lets go. Two launches, a SIGKILLed launcher and a fresh start
into another run's checkpoints: tests/e2e/test_run_dir_runs.py."""

from __future__ import annotations

import json
import os
import time

import pytest

from launcher import runlock


def test_a_lock_is_taken_over_only_from_a_launch_that_is_gone(tmp_path, monkeypatch):
    path = runlock.acquire(tmp_path)
    holder = json.loads(path.read_text())
    assert holder["pid"] == os.getpid() and not runlock.gone(holder)
    with pytest.raises(runlock.Held, match=f"pid {os.getpid()}"):
        runlock.acquire(tmp_path)
    # A dead pid on this host, or a live pid that now runs another process: gone.
    assert runlock.gone({**holder, "pid": 2**22 + 7})
    assert runlock.gone({**holder, "pid_start": "1"})
    old = {k: v for k, v in holder.items() if k != "pid_ns"}  # a record written before pid namespaces were
    assert runlock.gone({**old, "pid": 2**22 + 7}) and not runlock.gone(old)
    # The same pid in another pid namespace (a container) proves nothing.
    assert not runlock.gone({**holder, "pid": 2**22 + 7, "pid_ns": "pid:[1]"})
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


def test_rank_zero_waits_for_a_holder_that_lets_go_and_not_for_one_that_stays(tmp_path, monkeypatch):
    """runlock.rank_hold: a rank 0 started without a launcher waits up to RANK_WAIT_S for the
    lock (the submit of its own job still holding it), then takes it; a holder that stays is
    named after that wait. A rank its launcher started takes nothing."""
    import threading

    assert runlock.RANK_WAIT_S == 10  # what docs/reliability.md says (and a submit needs)
    monkeypatch.delenv(runlock.ENV, raising=False)
    monkeypatch.setattr(runlock, "RANK_WAIT_S", 3.0)
    submit = runlock.acquire(tmp_path)  # the submit, this process: a live holder
    threading.Timer(1.0, runlock.release, args=(submit,)).start()
    t0 = time.monotonic()
    with runlock.rank_hold([tmp_path]):
        assert 1.0 <= time.monotonic() - t0 < 3.0
        assert json.loads(submit.read_text())["pid"] == os.getpid()  # now the rank's
        t0 = time.monotonic()
        with pytest.raises(runlock.Held, match=f"pid {os.getpid()}"), runlock.rank_hold([tmp_path]):
            pass
        assert time.monotonic() - t0 >= 3.0
    assert not submit.exists()
    monkeypatch.setenv(runlock.ENV, "{}")
    with runlock.rank_hold([tmp_path]):
        assert not submit.exists()


def test_a_rank_killed_with_the_host_near_its_memory_limit_is_named_as_the_oom_killers():
    """The wording of the launcher's line for a SIGKILLed rank (launch/start/console.py), from
    torchrun's report as it prints it and the host's memory as sampled: under 5% available
    in the seconds before, the out-of-memory killer; plenty, something else."""
    import time

    from launcher.launch.start.console import Memory, killed, root_cause

    report = [
        "Root Cause (first observed failure):\n",
        "[0]:\n",
        "  rank      : 1 (local_rank: 1)\n",
        "  exitcode  : -9 (pid: 4242)  (SIGKILL)\n",
        "  traceback : Signal 9 (SIGKILL) received by PID 4242\n",
    ]
    failure = root_cause(report)
    assert (failure.rank, failure.exitcode, failure.pid) == (1, -9, 4242)
    tight = Memory(total=23 << 30, peaks={4242: 10 << 30})
    tight.recent.extend([(time.monotonic(), 5 << 30), (time.monotonic(), 300 << 20)])
    line = killed(failure, tight)
    assert line.startswith(
        "error: rank 1 (pid 4242) was killed by SIGKILL: most likely the kernel's out-of-memory "
        "killer (the host had 0.29 of 23.00 GiB available in the seconds before; its peak resident "
        "memory 10.00 GiB)"
    ), line
    roomy = Memory(total=23 << 30)
    roomy.recent.append((time.monotonic(), 20 << 30))
    assert "not for memory, it seems" in killed(failure, roomy)

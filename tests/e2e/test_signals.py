"""Stop signals end to end: SIGTERM and SIGUSR1 save and exit as preempted, Ctrl-C (once:
the step saved, exit 130; twice: at once), before the ranks start, while torchrun starts,
and a rank blocked in C++; real torchrun, 2 gloo processes, the tiny model."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from runs import REPO, in_fp32, launch, processes_of, rank_process, read_metrics
from runs import start as _start
from runs import wait_for_step as _wait_for_step

from launcher.launch import cli
from launcher.manifest import verify

pytestmark = pytest.mark.slow

NOTHING_TO_RESUME = (
    "no complete checkpoint was written, so there is nothing to resume. Launch the same run "
    "directory again to start the run over."
)
"""What a stop before any checkpoint says of a relaunch (issue 48, 9: "no complete checkpoint yet.
Launch the same run directory again to resume from it.", with nothing to resume)."""


STOP_STEPS = 12


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1"])
def test_stop_signal_saves_and_exits_as_preempted_then_resumes(tmp_path, sig):
    import signal

    from launcher.exits import EXIT_PREEMPTED

    run = tmp_path / "run"
    args = [  # the signal after step 3 and the stop of the step in flight: 12 steps leave room
        f"train.steps={STOP_STEPS}",
        "optim.warmup_steps=2",
        "logger=none",
        "logger.log_every=1",
        "checkpoint.every=1000",
        "checkpoint.save_final=true",
    ]
    if sig == "SIGUSR1":  # async saves every 2 steps, each held back 1 s: the marker waits for them
        args += ["checkpoint.async_save=true", "checkpoint.every=2", "debug.async_save_delay_s=1"]
    proc = _start(run, *args)
    _wait_for_step(run, 3, proc)
    proc.send_signal(getattr(signal, sig))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, out[-3000:]
    marker = json.loads((run / "preempted.json").read_text())
    assert marker["signal"] == sig and 3 <= marker["step"] < STOP_STEPS
    assert (run / "checkpoints" / "latest").read_text().splitlines()[0] == f"step_{marker['step']:08d}"
    assert verify(run / "checkpoints" / f"step_{marker['step']:08d}") is None
    assert marker["checkpoint"] == str(run / "checkpoints" / f"step_{marker['step']:08d}")
    assert (run / "checkpoints" / "latest").stat().st_mtime <= marker["time"]  # published before it was named
    assert read_metrics(run)[-1]["step"] == marker["step"]  # the step it was in finished
    assert f"preempted by {sig}" in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["preempted"] and summary["weights_digest_per_rank"] is None  # no full read of the weights now
    if sig == "SIGTERM":  # the next launch of the same run directory resumes and finishes
        proc2 = launch(*args, run_dir=run)
        assert f"at step {marker['step']}" in proc2.stdout
        assert [r["step"] for r in read_metrics(run)] == list(range(1, STOP_STEPS + 1))
        assert not (run / "preempted.json").exists()


def test_ctrl_c_saves_the_step_writes_the_summary_and_exits_130(tmp_path):
    """Ctrl-C as a terminal sends it: SIGINT to the launcher's whole process group. One line
    says what happens, the step in flight finishes and is saved, the summary is written,
    no traceback, exit 130."""
    import os
    import signal

    run = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "launcher",
        "train",
        f"hydra.run.dir={run}",
        *in_fp32(
            ["train.steps=200", "optim.warmup_steps=5", "logger=none", "logger.log_every=1", "checkpoint.every=1000"]
        ),
    ]
    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    _wait_for_step(run, 3, proc)
    os.killpg(proc.pid, signal.SIGINT)  # the terminal's foreground group: the launcher (torchrun has its own)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-3000:]
    marker = json.loads((run / "preempted.json").read_text())
    step = marker["step"]
    assert marker["signal"] == "SIGINT" and 3 <= step < 200
    assert verify(run / "checkpoints" / f"step_{step:08d}") is None
    assert read_metrics(run)[-1]["step"] == step
    summary = json.loads((run / "summary.json").read_text())
    assert summary["preempted"] == 1 and summary["weights_digest_per_rank"] is None  # not read on the way out
    # "(within about a second)", or the last step's time where a loaded machine made it longer
    assert re.search(
        r"^Ctrl-C: the ranks finish this step \(within about (a second|[^)]*: the last step took [^)]*)\), "
        r"save and stop \(Ctrl-C again to stop at once\)$",
        out,
        re.M,
    ), out[-3000:]
    assert out.strip().splitlines()[-1] == (
        f"interrupted (Ctrl-C) after step {step}; checkpoint "
        f"{run / 'checkpoints' / f'step_{step:08d}'}. Launch the same run "
        f"directory again to resume."
    )
    for noise in ("Traceback", "KeyboardInterrupt", "SignalException", "ChildFailedError"):
        assert noise not in out, out[-3000:]
    # The documented resume, RUN_DIR/command.sh, and its Ctrl-C: the same (issue 48, 6: torchrun's
    # warnings, a ~30-line traceback and exit 1)
    again = subprocess.Popen(
        ["bash", str(run / "command.sh")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    _wait_for_step(run, step + 3, again)
    os.killpg(again.pid, signal.SIGINT)
    out, _ = again.communicate(timeout=120)
    later = json.loads((run / "preempted.json").read_text())["step"]
    assert again.returncode == 130 and later > step, out[-3000:]
    assert out.strip().splitlines()[-1] == (
        f"interrupted (Ctrl-C) after step {later}; checkpoint "
        f"{run / 'checkpoints' / f'step_{later:08d}'}. Launch the same "
        f"run directory again to resume."
    )
    for noise in ("Traceback", "KeyboardInterrupt", "SignalException", "ChildFailedError", "torch.distributed"):
        assert noise not in out, out[-3000:]


def rank_started(run: Path) -> bool:
    """A rank process of this run exists (not torchrun, whose command line names the module too)."""
    for pid in processes_of(run):
        try:
            line = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # gone meanwhile
            continue
        if b"launcher.rank" in line and b"torch.distributed.run" not in line:
            return True
    return False


def test_ctrl_c_before_the_ranks_start(tmp_path):
    """Ctrl-C while the launcher imports: one line, nothing started, exit 130. Ctrl-C once
    the run directory is written, while torchrun and the ranks start: the launcher hands it
    to each rank as soon as it takes signals; they stop at once (nothing trained, nothing to
    save), with no KeyboardInterrupt traceback from torchrun or a rank."""
    import os
    import signal
    import time

    def popen(run):
        argv = [
            sys.executable,
            "-m",
            "launcher",
            "train",
            f"hydra.run.dir={run}",
            *in_fp32(["optim.warmup_steps=5", "logger=none", "checkpoint.every=1000"]),
        ]
        return subprocess.Popen(
            argv,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    proc = popen(tmp_path / "a")
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130 and out == "interrupted (Ctrl-C) before training started\n", out
    assert not (tmp_path / "a").exists()

    run = tmp_path / "b"
    proc = popen(run)
    deadline = time.monotonic() + 60
    while not rank_started(run):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)  # a rank has started: torch is still importing
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    assert json.loads((run / "preempted.json").read_text())["step"] is None
    assert not (run / "checkpoints").exists() and not processes_of(run)
    assert out.strip().splitlines()[-1] == ("interrupted (Ctrl-C) before the first step; " + NOTHING_TO_RESUME), out


def test_a_ctrl_c_while_torchrun_starts_is_held_and_handed_on(tmp_path, monkeypatch, capfd):
    """The Ctrl-C lands after the launcher's handlers are in and before torchrun runs (sent
    from inside the launcher's Popen of torchrun, in process): it is held, then handed to the
    ranks once they take signals; they stop at once, nothing trained, exit 130."""
    import os
    import signal

    from launcher.launch.start import supervise

    real, sent = subprocess.Popen, []

    def popen(argv, *args, **kwargs):
        if "torch.distributed.run" in argv and not sent:
            sent.append(argv)
            os.kill(os.getpid(), signal.SIGINT)  # its handler runs here, before torchrun exists
        return real(argv, *args, **kwargs)

    monkeypatch.setattr(supervise.subprocess, "Popen", popen)
    run = tmp_path / "run"
    rc = cli.main(["train", f"hydra.run.dir={run}", "optim.warmup_steps=5", "logger=none"])
    out, err = capfd.readouterr()
    assert sent and rc == 130, out[-2000:] + err[-3000:]
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err, err[-3000:]
    assert json.loads((run / "preempted.json").read_text())["step"] is None
    assert not (run / "checkpoints").exists() and not processes_of(run)
    assert err.count("Ctrl-C: the ranks finish this step") == 1, err[-3000:]
    assert out.strip().splitlines()[-1] == ("interrupted (Ctrl-C) before the first step; " + NOTHING_TO_RESUME), out[
        -3000:
    ]


def test_a_stop_signal_reaches_a_rank_blocked_in_cpp(tmp_path):
    """Rank 1 frozen as it starts, so rank 0 waits inside init_process_group (C++, where no
    Python handler runs until the call returns: here after the collective backstop, 90 s).
    SIGTERM to rank 0 ends it within seconds all the same: the signal module's wakeup fd
    wakes a thread of the rank (Preemption.install), which leaves preempted.json and exits 75."""
    import os
    import signal
    import time

    import psutil

    run = tmp_path / "run"
    proc = _start(run, "optim.warmup_steps=5", "logger=none", "dist.timeout_s=60")

    deadline = time.monotonic() + 60
    while (r1 := rank_process(run, 1)) is None:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    r1.suspend()
    try:
        r0 = rank_process(run, 0)
        # rank 0 has joined the job's store (a connection to it) and waits for rank 1's key
        while not any(c.status == psutil.CONN_ESTABLISHED for c in r0.net_connections(kind="tcp")):
            assert time.monotonic() < deadline and r0.is_running()
            time.sleep(0.1)
        time.sleep(2)
        assert r0.status() == psutil.STATUS_SLEEPING  # blocked, not importing
        t0 = time.monotonic()
        os.kill(r0.pid, signal.SIGTERM)
        r0.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        r1.kill()
    out = proc.communicate(timeout=120)[0]
    assert took < 5, took
    report = (
        run / "torchrun.log"
    ).read_text()  # torchrun's report of rank 0 (rank 1 was killed): its log, not the console
    assert "exitcode  : 75" in report and "exitcode" not in out, out[-3000:]
    marker = json.loads((run / "preempted.json").read_text())
    assert marker["step"] is None and marker["signal"] == "SIGTERM", marker


def test_a_stop_signal_before_the_first_step_stops_at_once(tmp_path):
    """SIGTERM (a scheduler) while the ranks start: they end at once, nothing to save;
    rank 0 leaves preempted.json without a step (a warned Slurm job requeues on it); exit 75."""
    import os
    import signal
    import time

    from launcher.launch.start.supervise import listening

    run = tmp_path / "run"
    proc = _start(run, "optim.warmup_steps=5", "logger=none")
    deadline = time.monotonic() + 60
    while len([pid for pid in processes_of(run) if listening(pid)]) < 2:  # both ranks take signals (torch imports)
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 75, out[-3000:]
    marker = json.loads((run / "preempted.json").read_text())
    assert marker["step"] is None and marker["signal"] == "SIGTERM", marker
    assert not (run / "checkpoints").exists() and not processes_of(run)
    assert out.strip().splitlines()[-1] == ("preempted by SIGTERM before the first step; " + NOTHING_TO_RESUME), out[
        -3000:
    ]


def test_a_second_ctrl_c_stops_at_once(tmp_path):
    """Ctrl-C, then Ctrl-C again while a rank is still inside its step (here stuck:
    debug.fault=hang): the launcher says so, torchrun and every rank end within seconds
    without saving and without tracebacks, the last checkpoint stays the newest and whole,
    exit 130."""
    import os
    import signal
    import time

    run = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "launcher",
        "train",
        f"hydra.run.dir={run}",
        *in_fp32(
            [
                "train.steps=200",
                "optim.warmup_steps=5",
                "logger=none",
                "logger.log_every=1",
                "checkpoint.every=2",
                "debug.fault=hang",
                "debug.fault_step=4",
                "debug.fault_rank=0",
            ]
        ),
    ]
    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    _wait_for_step(run, 3, proc)
    time.sleep(1)  # rank 0 sleeps in step 4 for good
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(1.5)  # a repeat within a second is one Ctrl-C delivered twice (preempt.AGAIN_S)
    os.killpg(proc.pid, signal.SIGINT)
    t0 = time.monotonic()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130 and time.monotonic() - t0 < 30, out[-3000:]
    assert "Ctrl-C again: stopping now" in out and "Traceback" not in out, out[-3000:]
    assert not processes_of(run)
    assert not (run / "preempted.json").exists()  # nothing saved on the way out
    assert (run / "checkpoints" / "latest").read_text().splitlines()[0] == "step_00000002"
    assert verify(run / "checkpoints" / "step_00000002") is None
    assert not list((run / "checkpoints").glob("step_00000004*"))

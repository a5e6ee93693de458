"""`launcher submit` on a real Slurm 22.05 (started here by tests/helpers/slurm_cluster.py):
jobs run to completion, a warned job checkpoints, requeues itself and resumes, failures
are not requeued, sweeps make one job per point. The --dry-run golden needs no cluster."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import wandb_file
from runs import FAST, REPO, launch, read_metrics, token_file
from slurm_cluster import slurm_cluster  # noqa: F401 - the fixture
from test_readme import readme_line

from launcher.launch import cli
from launcher.manifest import verify

# The jobs: 2 gloo ranks on the one node (2 CPUs), W&B offline.
JOB = ["cluster.nproc_per_node=2", "cluster.cpus_per_task=2", *FAST]


# Recipes submitted end to end. A recipe joins with one entry.
SUBMITTED_RECIPES = ["ddp", "zero2"]


def hydra_quote(value: str) -> str:
    """A value with spaces and quotes as one Hydra override value."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def submit(cluster, *overrides: str, run_dir: Path | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """`python -m launcher submit ...` with the cluster's SLURM_CONF, as a user runs it."""
    args = ([f"hydra.run.dir={hydra_quote(str(run_dir))}"] if run_dir else []) + list(overrides)
    # As from a login shell: no DS_ACCELERATOR (this test process may have set one for itself).
    return launch(
        *args,
        command="submit",
        env={"SLURM_CONF": cluster.env["SLURM_CONF"], "DS_ACCELERATOR": None},
        timeout=120,
        check=check,
    )


def job_id_of(run_dir: Path, proc: subprocess.CompletedProcess) -> str:
    job_id = (run_dir / "slurm_job_id").read_text().strip()
    assert f"submitted job {job_id}: run directory {run_dir}, log {run_dir / f'slurm-{job_id}.out'}" in proc.stdout
    return job_id


def wait_for_step(run_dir: Path, step: int, cluster, job_id: str, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        path = run_dir / "metrics.jsonl"
        if path.exists() and len(path.read_text().splitlines()) >= step:
            return
        state = cluster.job(job_id)["JobState"]
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), (state, _log(run_dir, job_id)[-4000:])
        time.sleep(0.2)
    raise AssertionError(f"no step {step} within {timeout} s:\n{_log(run_dir, job_id)[-4000:]}")


def _log(run_dir: Path, job_id: str) -> str:
    path = run_dir / f"slurm-{job_id}.out"
    return path.read_text() if path.exists() else "(no log)"


def created_by_injection(name: str, *folders: Path) -> list[Path]:
    """Where a `touch NAME` smuggled into a script would land: the folders the job's shells
    run in (the run directory, the repository) and the usual suspects."""
    places = [Path("/"), Path("/tmp"), Path.home(), REPO, *folders]
    return [p / name for p in places if (p / name).exists()] + [p for f in folders for p in f.rglob(name)]


# ----------------------------------------------------------------------------- real Slurm
@pytest.mark.slow
@pytest.mark.parametrize("recipe", SUBMITTED_RECIPES)
def test_submitted_job_runs_to_completion(recipe, slurm_cluster, tmp_path):
    """A run directory full of shell metacharacters: the job still runs, nothing is executed.
    The job's environment is the user's, not what the launch side set for the login node."""
    token = f"pwned-{uuid.uuid4().hex[:8]}"
    run_dir = tmp_path / f"run $(touch {token}); `touch {token}` 'q' \"dq\" & x"
    proc = submit(slurm_cluster, f"recipe={recipe}", *JOB, "cluster.setup=['env > job.env']", run_dir=run_dir)
    job_id = job_id_of(run_dir, proc)
    info = slurm_cluster.wait_for_end(job_id)
    log = _log(run_dir, job_id)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, log)
    assert info["Restarts"] == "0"
    assert info["JobName"] == f"{tmp_path.name}-{run_dir.name}"  # sbatch read the quoted name back exactly
    assert info["StdOut"] == str(run_dir / f"slurm-{job_id}.out")
    assert "training finished" in log and "Traceback" not in log

    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert (run_dir / "checkpoints" / "latest").read_text().splitlines()[0] == "step_00000012"
    assert verify(run_dir / "checkpoints" / "step_00000012") is None
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["preempted"] == 0
    job_env = dict(line.split("=", 1) for line in (run_dir / "job.env").read_text().splitlines() if "=" in line)
    assert job_env["SLURM_JOB_ID"] == job_id and "DS_ACCELERATOR" not in job_env  # the login node's guess stays there
    if recipe.startswith("zero"):  # the generated DeepSpeed config travelled with the job
        assert json.loads((run_dir / "ds_config.json").read_text())["zero_optimization"]["stage"] == int(recipe[4])
    runs = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    assert wandb_file.run_info(runs[0])["id"] == (run_dir / "wandb_id").read_text().strip()
    assert [h["_step"] for h in wandb_file.history(runs[0])] == list(range(1, 13))
    assert created_by_injection(token, tmp_path, slurm_cluster.folder) == [], "a metacharacter was executed"
    if recipe == "ddp":  # the ranks imported the code copied at submit (cluster.snapshot_code), not the checkout
        hosts = json.loads((run_dir / "provenance" / "hosts.jsonl").read_text())
        assert Path(hosts["code"]) == run_dir / "code" and hosts["world"] == 2, hosts
        assert json.loads((run_dir / "provenance.json").read_text())["argv"][0] == "submit"
        resubmit_a_finished_run_by_hand(slurm_cluster, run_dir)


SETUP_WRITES = ("job.env",)  # cluster.setup's `env > job.env` runs in every job


def resubmit_a_finished_run_by_hand(cluster, run_dir: Path) -> None:
    """docs/launching.md's line for resuming by hand, on a finished run: a new job that says there
    is nothing to train and rewrites nothing (its summary, metrics and checkpoints stay)."""
    line = readme_line("cd RUN_DIR && sbatch job.sbatch").replace("RUN_DIR", shlex.quote(str(run_dir)))
    before = {
        p: p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.name not in SETUP_WRITES and not p.name.startswith("slurm-")
    }
    proc = subprocess.run(
        ["bash", "-c", line],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in cluster.env.items() if k != "DS_ACCELERATOR"},
    )
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.split()[-1]
    info = cluster.wait_for_end(job_id)
    log = _log(run_dir, job_id)
    assert info["JobState"] == "COMPLETED", (info, log)
    assert "nothing to train: " in log and "raise train.steps" in log, log[-3000:]
    after = {
        p: p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.name not in SETUP_WRITES and not p.name.startswith("slurm-")
    }
    assert after == before


@pytest.mark.slow
def test_warned_job_checkpoints_requeues_and_resumes(slurm_cluster, tmp_path):
    """The warning signal (what --signal=B:USR1@grace sends before the time limit): the
    ranks save, the job requeues itself and the requeued job resumes in the same run."""
    run_dir = tmp_path / "preempted"
    proc = submit(slurm_cluster, *JOB, "train.steps=24", "checkpoint.every=1000", run_dir=run_dir)
    job_id = job_id_of(run_dir, proc)
    wait_for_step(run_dir, 4, slurm_cluster, job_id)
    # While it trains, its rank 0 holds the run directory's lock (no launcher runs in a job):
    # read the lock, then the metrics; a step still to come means rank 0 held it at the read.
    lock = run_dir / ".launch.lock"
    holder = json.loads(lock.read_text()) if lock.exists() else None
    if len(read_metrics(run_dir)) < 24:
        assert holder is not None and holder["slurm_job_id"] == job_id and holder["slurm_restart"] == "0", holder
    slurm_cluster.run("scancel", "--signal=USR1", "--batch", job_id)
    info = slurm_cluster.wait_for_end(job_id)
    log = _log(run_dir, job_id)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, log)
    assert info["Restarts"] == "1", log  # requeued exactly once

    # The log tells the story: warned, saved at step K, requeued, resumed from step K.
    marker = json.loads(log.split("preempted: ", 1)[1].splitlines()[0])
    k = marker["step"]
    assert marker["signal"] == "SIGUSR1" and 4 <= k < 24, marker
    assert "SIGUSR1: asking the ranks to checkpoint and stop" in log
    assert f"requeueing job {job_id}" in log
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{k:08d}'} at step {k}" in log
    assert log.count("training finished") == 1 and "restart 1] training finished" in log
    assert not (run_dir / "preempted.json").exists()

    # Every step once; the loss carries on from where it stopped, not from scratch.
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 25))
    loss = {r["step"]: r["loss"] for r in rows}
    assert abs(loss[k + 1] - loss[k]) < 0.1 * loss[k] and loss[k + 1] < loss[1] - 0.3, (loss[1], loss[k], loss[k + 1])
    assert loss[24] < loss[k]
    assert (run_dir / "checkpoints" / "latest").read_text().splitlines()[0] == "step_00000024"
    # One W&B run across the requeue.
    runs = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 2 and len({wandb_file.run_info(r)["id"] for r in runs}) == 1, (
        "the requeue started a new W&B run"
    )
    assert [h["_step"] for h in wandb_file.history(runs[1])] == list(range(k + 1, 25))


@pytest.mark.slow
def test_failed_job_is_not_requeued(slurm_cluster, tmp_path):
    """Training that fails for another reason (its token file vanished after submission)
    ends the job as failed, once, with the reason in the log."""
    tokens = token_file(tmp_path, "some text to train on. " * 200)
    run_dir = tmp_path / "fails"
    proc = submit(slurm_cluster, *JOB, "data=memmap", f"data.path={tokens}", run_dir=run_dir)
    job_id = job_id_of(run_dir, proc)
    tokens.unlink()
    info = slurm_cluster.wait_for_end(job_id)
    log = _log(run_dir, job_id)
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", (info, log)
    assert "(not a preemption): not requeued" in log
    assert "requeueing" not in log


@pytest.mark.slow
def test_sweep_submits_one_job_per_point(slurm_cluster, tmp_path):
    """`make submit ARGS="-m optim.lr=1e-4,3e-4"`: a job and a run directory per point
    (held, so nothing trains; the jobs are read back from Slurm and cancelled)."""
    sweep = tmp_path / "sweep"
    proc = launch(
        "-m",
        "optim.lr=1e-4,3e-4",
        f"hydra.sweep.dir={sweep}",
        "cluster.sbatch_extra=['--hold']",
        *JOB,
        command="submit",
        env={"SLURM_CONF": slurm_cluster.env["SLURM_CONF"]},
        timeout=120,
    )
    ids = []
    for i, lr in enumerate((1e-4, 3e-4)):
        run_dir = sweep / str(i)
        job_id = job_id_of(run_dir, proc)
        ids.append(job_id)
        info = slurm_cluster.job(job_id)
        assert info["JobState"] == "PENDING" and info["Reason"] == "JobHeldUser", info
        assert info["WorkDir"] == str(run_dir) and info["JobName"] == f"sweep-{i}"
        assert f"lr: {lr}" in (run_dir / "config.yaml").read_text()
        assert shlex.quote(str(run_dir)) in (run_dir / "job.sbatch").read_text()
    assert len(set(ids)) == 2

    # A queued job owns its run directory before it starts: another job, or a launch here,
    # into it is refused in one line, and nothing there changes.
    first = sweep / "0"
    files = {p: p.read_bytes() for p in first.rglob("*") if p.is_file()}
    env = {"SLURM_CONF": slurm_cluster.env["SLURM_CONF"]}
    for command, extra in (("submit", ["cluster.sbatch_extra=['--hold']"]), ("train", [])):
        again = launch(f"hydra.run.dir={first}", *extra, *JOB, command=command, env=env, check=False)
        lines = again.stderr.strip().splitlines()
        assert again.returncode == 2 and len(lines) == 1, again.stdout[-2000:] + again.stderr[-2000:]
        assert f"belongs to Slurm job {ids[0]} (PENDING)" in lines[0], lines
    assert {p: p.read_bytes() for p in first.rglob("*") if p.is_file()} == files
    slurm_cluster.run("scancel", *ids)


@pytest.mark.slow
def test_job_refused_by_sbatch_leaves_nothing(slurm_cluster, tmp_path, monkeypatch, capsys):
    """What only Slurm can judge (a partition it does not have): sbatch's reason on one
    line, exit 2, and no run directory left behind."""
    monkeypatch.setenv("SLURM_CONF", slurm_cluster.env["SLURM_CONF"])
    monkeypatch.chdir(REPO)
    run_dir = tmp_path / "refused"
    code = cli.main(["submit", *JOB, "cluster.partition=nosuch", f"hydra.run.dir={run_dir}"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: sbatch refused the job") and "invalid partition" in err.lower(), err
    assert not run_dir.exists()


@pytest.mark.slow
def test_a_lock_of_a_slurm_job_is_taken_over_once_squeue_says_it_ended(slurm_cluster, tmp_path, monkeypatch):
    """A lock left on a shared run directory by a job on another node: held while the real
    Slurm says that job is pending or running, taken over once it says the job ended (or no
    longer knows it). runlock asks squeue, which needs only SLURM_CONF."""
    from launcher import runlock

    monkeypatch.setenv("SLURM_CONF", slurm_cluster.env["SLURM_CONF"])
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    job = slurm_cluster.run("sbatch", "--parsable", "--wrap", "sleep 300", f"--chdir={tmp_path}").stdout.strip()
    lock = tmp_path / runlock.LOCK
    holder = {
        "host": "other-node.invalid",
        "pid": 4242,
        "pid_start": "1",
        "pid_ns": "pid:[1]",
        "slurm_job_id": job,
        "slurm_restart": "0",
        "started": time.time(),
    }
    lock.write_text(json.dumps(holder))
    assert runlock.slurm_job_states(job) in (["PENDING"], ["RUNNING"], ["CONFIGURING"])
    with pytest.raises(runlock.Held, match=f"Slurm job {job}"):
        runlock.acquire(tmp_path)
    slurm_cluster.run("scancel", job)
    assert slurm_cluster.wait_for_end(job)["JobState"] == "CANCELLED"
    assert runlock.slurm_job_ended(job)
    assert json.loads(runlock.acquire(tmp_path).read_text())["pid"] == os.getpid()  # taken over
    assert runlock.slurm_job_states("99999999") == [] and runlock.slurm_job_ended("99999999")  # never known
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "no-such-slurm.conf"))  # squeue cannot ask: proves nothing
    assert runlock.slurm_job_states(job) is None and not runlock.slurm_job_ended(job)

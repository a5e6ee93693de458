"""One launch owns a run directory: a second is refused while the first runs, the ranks of
a launcher killed with SIGKILL stop (saving) instead of training on unsupervised, the next
launch takes the stale lock over, and a relaunch of a finished run changes nothing. One run
per checkpoint folder: a fresh start where another run's checkpoints are is refused, or
moves that run aside whole (checkpoint.on_existing=archive)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runs import FAST, REPO, here, launch, processes_of, start, wait_for_step

from launcher import runlock
from launcher.manifest import read_latest, run_of, verify


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
    # Another run directory whose checkpoint.dir is this run's checkpoint folder: the same.
    other = launch(
        "cluster.nproc_per_node=2",
        *FAST,
        "logger=none",
        f"checkpoint.dir={run / 'checkpoints'}",
        run_dir=tmp_path / "other",
        check=False,
    )
    lines = [line for line in other.stderr.splitlines() if line.strip()]
    assert other.returncode == 2 and len(lines) == 1, other.stderr[-2000:]
    assert f"{run / 'checkpoints'} is in use by the launch" in lines[0] and f"pid {first.pid}" in lines[0], lines
    assert not (tmp_path / "other").exists()

    # Without the launcher: the run's command.sh says so at once (its rendezvous would wait);
    # torchrun typed by hand gets as far as rank 0, which refuses before writing anything.
    assert runlock.ENV not in (run / "command.sh").read_text()  # its torchrun is no launcher's: rank 0 checks
    script = subprocess.run([str(run / "command.sh")], capture_output=True, text=True, timeout=60)
    assert script.returncode == 2 and script.stderr.startswith("error: ") and "is in use by the launch" in script.stderr
    assert len(script.stderr.strip().splitlines()) == 1, script.stderr
    metrics = (run / "metrics.jsonl").read_bytes()
    t0 = time.monotonic()  # rank 0 refuses after waiting RANK_WAIT_S; rank 1, blocked joining it, stops at once
    by_hand = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "launcher.rank",
            str(run),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert by_hand.returncode != 0 and f"error: {run} is in use by the launch" in by_hand.stderr, by_hand.stderr[-3000:]
    assert time.monotonic() - t0 < runlock.RANK_WAIT_S + 20, "torchrun waited for a rank that could not start"
    assert (run / "metrics.jsonl").read_bytes()[: len(metrics)] == metrics and (
        run / "config.yaml"
    ).read_bytes() == config

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
    assert not (run / runlock.LOCK).exists() and not (run / "checkpoints" / runlock.LOCK).exists()
    summary = (run / "summary.json").read_bytes()
    files = sorted(str(p) for p in run.rglob("*"))

    again = launch("cluster.nproc_per_node=2", *FAST, f"train.steps={step + 2}", "logger=none", run_dir=run)
    lines = [line for line in again.stdout.splitlines() if line.strip()]
    assert lines == [
        f"nothing to train: {run} has a checkpoint at step {step + 2} of train.steps={step + 2}; "
        f"raise train.steps to train on"
    ], again.stdout
    assert (run / "summary.json").read_bytes() == summary and sorted(str(p) for p in run.rglob("*")) == files


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_fresh_start_never_mixes_two_runs(tmp_path):
    """Also: a relaunch with another model shape or a recipe that cannot read the format is
    refused on the launch side (issue: five rank tracebacks of `size mismatch`)."""
    run = tmp_path / "r"
    ckpts = run / "checkpoints"
    base = [
        "train.steps=4",
        "checkpoint.every=2",
        "optim.warmup_steps=1",
        "logger.log_every=1",
        "logger.name=none",
        "cluster.nproc_per_node=1",
        "train.micro_batch=4",
        "train.grad_accum=2",
    ]
    launch(*base, run_dir=run)
    first = (run / "config.yaml").read_text().split("run_id: ", 1)[1].split()[0]

    # A relaunch naming neither the batch nor the model keeps the run's (issue 48: `train.steps=30`
    # alone resumed a run of micro_batch 4 x grad_accum 4 with a global batch of 16, not 32), at
    # another process count too, through train.global_batch; one line says so. Dry runs: nothing moves.
    plain = [o for o in base if not o.startswith(("train.micro_batch", "train.grad_accum"))]
    for procs in (1, 2):
        proc = launch(*plain[:-1], f"cluster.nproc_per_node={procs}", "train.steps=6", "--dry-run", run_dir=run)
        config = proc.stdout.split("\ntrain:\n", 1)[1]
        assert "  micro_batch: 4\n  grad_accum: 2\n" in config
        assert ("  global_batch: null\n" if procs == 1 else "  global_batch: 8\n") in config
        said = [line for line in proc.stderr.splitlines() if "resumes its run" in line]
        assert len(said) == 1 and "the run's own train.micro_batch=4, train.grad_accum=2" in said[0], proc.stderr
        assert ("global batch of 8 samples at 2 process(es)" in said[0]) is (procs == 2), said[0]
    assert [run_of(f) for f in sorted(ckpts.glob("step_*"))] == [first, first]
    assert read_latest(ckpts) == ("step_00000004", first)
    before = snapshot(run)

    # A fresh start, or a start from the run's older checkpoint: refused, nothing touched.
    for resume in ("never", str(ckpts / "step_00000002")):
        proc = launch(*base, f"checkpoint.resume={resume}", run_dir=run, check=False)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and f"holds run {first}'s checkpoints (step_00000002..step_00000004)" in lines[0]
        assert "checkpoint.on_existing=archive" in lines[0] and "rank" not in proc.stdout
        assert snapshot(run) == before

    # A relaunch whose model or recipe cannot load the checkpoint: refused, naming what differs.
    for change, words in (
        (["model.dim=96"], ["holds another model (model.dim=128 there, 96 here;", "tensors differ"]),
        (
            ["recipe=zero2"],
            [
                "is a ddp checkpoint",
                "recipe=zero2 cannot load",
                "a recipe whose engine is ddp/fsdp/pp/pp_fsdp/tp/tp_fsdp",
            ],
        ),
    ):
        proc = launch(*base, *change, run_dir=run, check=False)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
        assert lines[0].startswith(f"error: checkpoint.resume=auto: {ckpts / 'step_00000004'}")
        assert all(w in lines[0] for w in words) and "hydra.run.dir" in lines[0], lines[0]
        assert snapshot(run) == before
        if change == ["model.dim=96"]:  # how many differ, and one of them with both shapes
            import re

            found = re.search(
                r"; (\d+) of (\d+) tensors differ, e\.g\. (\S+) \[([\d, ]+)\] there, \[([\d, ]+)\] here\)", lines[0]
            )
            assert found and 0 < int(found.group(1)) <= int(found.group(2)), lines[0]
            theirs, ours = (list(map(int, found.group(i).split(", "))) for i in (4, 5))
            assert 128 in theirs and 96 in ours and 96 not in theirs, lines[0]

    # Roll back to step 2 as a new run: the old one moves aside whole, nothing is deleted,
    # its W&B id included (the new run must not log into the old one's W&B run).
    (run / "wandb_id").write_text("old0run1\n")
    proc = launch(
        *base,
        "train.steps=6",
        f"checkpoint.resume={ckpts / 'step_00000002'}",
        "checkpoint.on_existing=archive",
        run_dir=run,
    )
    home = run / "archive" / first
    assert f"resumed from {home / 'checkpoints' / 'step_00000002'} at step 2" in proc.stdout
    moved = snapshot(home)
    assert moved == {
        **{
            k: v
            for k, v in before.items()
            if k.startswith("checkpoints/") or k in ("config.yaml", "command.sh", "metrics.jsonl", "summary.json")
        },
        "wandb_id": b"old0run1\n",
    }
    assert not (run / "wandb_id").exists()
    exported = here("export", str(home))  # the archive reads as a run directory
    assert (home / "export" / "step_00000004" / "model.safetensors").is_file(), exported.stdout
    assert all(verify(f) is None for f in (home / "checkpoints").glob("step_*"))
    second = read_latest(ckpts)[1]
    assert second not in (None, first)
    assert sorted(f.name for f in ckpts.glob("step_*")) == ["step_00000004", "step_00000006"]
    assert {run_of(f) for f in ckpts.glob("step_*")} == {second}
    rows = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows == [3, 4, 5, 6]  # the new run's own record, not appended to the old one's

    # resume=auto continues the new run.
    proc = launch(*base, "train.steps=7", run_dir=run)
    assert f"resumed from {ckpts / 'step_00000006'} at step 6" in proc.stdout
    assert read_latest(ckpts) == ("step_00000007", second)
    # resume= the folder's newest checkpoint by its path continues the same run, too.
    proc = launch(*base, "train.steps=8", f"checkpoint.resume={ckpts / 'step_00000007'}", run_dir=run)
    assert f"resumed from {ckpts / 'step_00000007'} at step 7" in proc.stdout
    assert read_latest(ckpts) == ("step_00000008", second) and run_of(ckpts / "step_00000008") == second

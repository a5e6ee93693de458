"""Reliability: kills, crashes, hangs, full disks, secrets and shell metacharacters,
each with real processes. docs/reliability.md reports these tests' figures."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import runs
import torch
from runs import REPO, launch, rank_process, read_metrics, wait_for_step

from launcher.exits import EXIT_CHECKPOINT_FAILED, EXIT_HANG
from launcher.manifest import find_latest, verify

pytestmark = pytest.mark.slow

COMMON = [
    "train.steps=16",
    "optim.warmup_steps=2",
    "logger=none",
    "logger.log_every=1",
    "checkpoint.every=5",
    "checkpoint.keep=2",
]


def start(run_dir: Path, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    return runs.start(run_dir, *overrides, env=env, split_stderr=True)


def final_weights(run_dir: Path, step: int = 16) -> dict:
    """Full weights of a checkpoint, whatever recipe wrote it (the export path)."""
    import engines
    from launcher.config import load_frozen

    return engines.consolidate(load_frozen(run_dir), run_dir / f"checkpoints/step_{step:08d}/engine")


REFERENCES: dict[str, Path] = {}


def reference_for(recipe: str, tmp_path_factory) -> Path:
    """The uninterrupted run every kill of this recipe is compared with (made once)."""
    if recipe not in REFERENCES:
        run = tmp_path_factory.mktemp(f"reference-{recipe}") / "run"
        launch(*COMMON, f"recipe={recipe}", run_dir=run)
        REFERENCES[recipe] = run
    return REFERENCES[recipe]


@pytest.fixture
def reference(tmp_path_factory) -> Path:
    return reference_for("ddp", tmp_path_factory)


# ----------------------------------------------------------------------------- 1. SIGKILL
# Seeded: the same "random" steps every run, one set per recipe (DDP, FSDP's DCP shards,
# DeepSpeed's ZeRO shards: three different checkpoint writers). fsdp and zero2 save with
# checkpoint.async_save (zero2's writes held back a second while training goes on): a
# resume from their async checkpoints ends bit-identical to the run that saved
# synchronously; ddp's staged copy: test_a_kill_while_an_async_save_writes_...
ASYNC = {
    "ddp": [],
    "fsdp": ["checkpoint.async_save=true"],
    "zero2": ["checkpoint.async_save=true", "debug.async_save_delay_s=1"],
}
KILLS = [
    (recipe, tuple(sorted(random.Random(f"{recipe}-6").sample(range(2, 15), n))))
    for recipe, n in (("ddp", 2), ("fsdp", 1), ("zero2", 1))
]
"""recipe: the steps after which rank 1 is killed, one run each recipe. ddp's two kills
(steps 2 and 7: one before the first checkpoint, one after) hit the same run, the second
in the group the first kill restarted: one launch, one set of start-ups fewer."""


def kill_rank_1_after(run: Path, step: int, proc: subprocess.Popen) -> int:
    """SIGKILL of rank 1 (the rank that does not log) once metrics.jsonl holds `step` rows
    (a restarted group rewrites it from its checkpoint on); the step of `latest` then."""
    wait_for_step(run, step, proc)
    victim = rank_process(run, 1)
    assert victim is not None, "no rank 1 process"
    victim.kill()
    pointer = run / "checkpoints" / "latest"
    return int(pointer.read_text().splitlines()[0][5:]) if pointer.exists() else 0


@pytest.mark.parametrize("recipe,kills", KILLS, ids=[f"{r}-{'-'.join(map(str, k))}" for r, k in KILLS])
def test_a_killed_rank_restarts_resumes_and_ends_bit_identical(recipe, kills, tmp_path_factory, tmp_path):
    reference = reference_for(recipe, tmp_path_factory)
    run = tmp_path / "run"
    restarts = f"cluster.max_restarts={len(kills) + 1}"
    proc = start(run, *COMMON, f"recipe={recipe}", restarts, *ASYNC[recipe])
    newest = [kill_rank_1_after(run, step, proc) for step in kills]
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    starts = out.split("rank(s) on cpu")
    assert len(starts) == 2 + len(kills), "the group was not restarted once per kill"
    for i, latest in enumerate(newest, start=1):  # the text before attempt i's announcement
        resumed = re.search(r"resumed from \S+/step_(\d+) at step (\d+) ", starts[i])
        # the restarted group starts from the newest complete checkpoint: `latest` when rank 1
        # was killed, or (rank 0 may finish a save whose digests rank 1 had sent) one save later
        assert (int(resumed.group(2)) if resumed else 0) in (latest, latest + 5), (kills, i, starts[i][-2000:])
    want, got = final_weights(reference), final_weights(run)
    assert all(torch.equal(want[k], got[k]) for k in want), f"weights differ after kills after steps {kills}"
    assert read_metrics(run)[-1]["loss"] == read_metrics(reference)[-1]["loss"]
    if ASYNC[recipe]:  # the saves were asynchronous indeed, into buffers made after the first step
        assert "written in the background" in out and "MiB of host memory staged in" in out, out[-2000:]


# ----------------------------------------------------------------------------- 2. kill in a save
KILLED: dict[str, tuple[Path, subprocess.CompletedProcess]] = {}


def killed_in_save(point: str, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A run killed by debug.fault=`point` in its step-10 save, launched once per point (the
    cases that damage or resume it work on copies)."""
    if point not in KILLED:
        run = tmp_path_factory.mktemp(f"killed-{point}") / "run"
        KILLED[point] = (
            run,
            launch(
                *COMMON, f"debug.fault={point}", "debug.fault_step=10", "debug.fault_rank=0", run_dir=run, check=False
            ),
        )
    return KILLED[point]


@pytest.mark.parametrize(
    "point,resumes_from,corrupt",
    [
        ("save_engine_written", 5, False),
        ("save_manifest_written", 5, False),
        ("save_renamed", 10, False),
        ("save_latest_written", 10, False),
        ("save_latest_written", 5, True),
    ],
)
def test_a_kill_inside_a_save_keeps_the_last_complete_checkpoint(
    point, resumes_from, corrupt, reference, tmp_path, tmp_path_factory
):
    """`corrupt`: then a byte of rank 1's share of step 10 is flipped (same size): the ranks,
    each checking its own share of the digests, agree to skip it for step 5. The next launch
    resumes from what find_latest names (checked for every point): it runs, to the
    uninterrupted run's weights, after a kill with `latest` behind (a manifest written, the
    pointer not moved), with `latest` moved, and with a damaged share."""
    source, proc = killed_in_save(point, tmp_path_factory)
    run = shutil.copytree(source, tmp_path / "run", symlinks=True)  # this case's own copy of the killed run
    assert proc.returncode != 0 and f"injected fault {point} at step 10" in proc.stderr
    ckpts = run / "checkpoints"
    latest = (ckpts / "latest").read_text().splitlines()[0]
    assert latest == f"step_{10 if point == 'save_latest_written' else 5:08d}", latest  # moved only by its own rename
    assert verify(ckpts / latest) is None, "latest names a partial checkpoint"
    assert verify(ckpts / "step_00000005") is None, "the previous checkpoint was damaged"
    if corrupt:
        share = ckpts / "step_00000010" / "trainer" / "rank_00001.pt"
        data = bytearray(share.read_bytes())
        data[len(data) // 2] ^= 0xFF
        share.write_bytes(bytes(data))
    assert find_latest(ckpts).name == f"step_{resumes_from:08d}"
    if point not in ("save_manifest_written", "save_latest_written"):
        return  # the same resume as save_manifest_written's (from 5) or save_latest_written's (from 10)
    proc = launch(*COMMON, run_dir=run)  # the next launch resumes from the last complete one
    assert f"at step {resumes_from} " in proc.stdout
    if corrupt:
        assert "step_00000010 skipped: trainer/rank_00001.pt fails its sha256" in proc.stderr, proc.stderr[-2000:]
    want, got = final_weights(reference), final_weights(run)
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_a_kill_while_an_async_save_writes_keeps_the_last_checkpoint(reference, tmp_path):
    """checkpoint.async_save (ddp): rank 1 is killed from its writer thread after the state
    of step 10 was staged, while training goes on; nothing of step 10 is published, step 5
    stays whole and the next launch resumes there and ends on the uninterrupted run's
    weights. Every write waits a second while the steps go on: step 5's staged copy, not
    the weights of a later step, is what was written."""
    run = tmp_path / "run"
    proc = launch(
        *COMMON,
        "checkpoint.async_save=true",
        "debug.async_save_delay_s=1",
        "debug.fault=save_staged",
        "debug.fault_step=10",
        "debug.fault_rank=1",
        run_dir=run,
        check=False,
    )
    assert proc.returncode != 0 and "injected fault save_staged at step 10" in proc.stderr
    assert "checkpoint" in proc.stdout and "step_00000005 written in the background" in proc.stdout
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text().splitlines()[0] == "step_00000005"
    assert verify(ckpts / "step_00000005") is None and not (ckpts / "step_00000010").exists()
    assert (ckpts / "step_00000010.tmp").is_dir()  # left as it was, never read
    proc = launch(*COMMON, "checkpoint.async_save=true", run_dir=run)
    assert "at step 5 " in proc.stdout
    want, got = final_weights(reference), final_weights(run)
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert not list(ckpts.glob("*.tmp")) and sorted(p.name for p in ckpts.glob("step_*")) == [
        "step_00000015",
        "step_00000016",
    ]


# ----------------------------------------------------------------------------- 3. a hang
def test_a_silent_rank_ends_the_job_with_a_message_naming_it(tmp_path):
    """Rank 1 stops inside step 6 before its first collective (a rank stuck in a kernel or a
    host call): both ranks are inside the same step, so only the collectives tell them apart.
    The flight recorder's counts name rank 1; each rank writes its record for torch's
    analyzer (the record of rank 0 holds the all-reduce that rank 1 never entered). The
    watchdog's message, from the step and the phase alone, is checked in tests/unit/test_watchdog.py."""
    run = tmp_path / "run"
    t0 = time.time()
    proc = launch(
        "train.steps=40",
        "optim.warmup_steps=2",
        "logger=none",
        "logger.log_every=1",
        "dist.timeout_s=10",
        "debug.fault=hang_in_step",
        "debug.fault_step=6",
        "debug.fault_rank=1",
        run_dir=run,
        check=False,
        timeout=300,
    )
    elapsed = time.time() - t0
    assert proc.returncode == EXIT_HANG and "ChildFailedError" not in proc.stderr, proc.stderr[-3000:]
    hang = json.loads((run / "hang.json").read_text())  # written by the watchdog, not the backstop
    assert hang["silent"] == [1] and hang["step"] == 6
    assert hang["behind"] == [] and hang["frozen"] == []  # same step, same phase; its watchdog still beats
    assert hang["behind_in_collectives"] == [1]
    found = re.search(
        r"hang: no progress for (\d+)s \(dist\.timeout_s=10\) in step 6; silent: rank\(s\) 1; "
        r"rank 0 inside the step after step 5, waiting in collective (\d+) of process group 0; "
        r"rank 1 inside the step after step 5, has entered (\d+) collectives of process group 0, "
        r"the others (\d+)",
        proc.stderr,
    )
    assert found and 10 <= int(found.group(1)) <= 20, proc.stderr[-3000:]  # within a check interval of the timeout
    waited, entered, top = map(int, found.groups()[1:])
    assert entered < waited == top, found.group(0)
    # Each rank's flight record, read by torch's own analyzer's loader.
    from torch.distributed.flight_recorder.components.loader import read_dump

    assert hang["comm_trace"] == str(run / "comm_trace")
    records = {r: read_dump("rank_", str(run / "comm_trace" / f"rank_{r}")) for r in (0, 1)}
    seq = {r: {e["collective_seq_id"] for e in d["entries"] if e["pg_id"] == 0} for r, d in records.items()}
    assert max(seq[0]) == top and max(seq[1]) == entered, (max(seq[0]), max(seq[1]))
    assert all(e["profiling_name"].startswith("gloo:") for d in records.values() for e in d["entries"])
    # Every rank's Python stacks (faulthandler, from its watchdog thread), named in the message:
    # rank 1's main thread in the injected sleep, rank 0's inside the step (its collective).
    assert (
        hang["stacks"] == str(run / "hang")
        and f"Python stacks of rank(s) 0, 1 in {run / 'hang'}/rank<N>.txt" in proc.stderr
    )
    stacks = {r: (run / "hang" / f"rank{r}.txt").read_text() for r in (0, 1)}
    assert re.search(r'File ".*faults\.py", line \d+ in strike', stacks[1]), stacks[1]
    assert "in train_step" in stacks[0] and "faults.py" not in stacks[0], stacks[0]
    assert all("launcher-watchdog" in t or "_report_and_exit" in t for t in stacks.values())
    print(f"hang detected and job ended {elapsed:.0f}s after launch (dist.timeout_s=10)")


def test_a_frozen_rank_is_named_by_its_stopped_heartbeat(tmp_path):
    """SIGSTOP (a node swapping to death, a process frozen by a debugger): rank 1's watchdog
    stops too, so nothing of rank 1 reports; rank 0 names it by its heartbeat's silence."""
    run = tmp_path / "run"
    proc = start(
        run,
        "train.steps=100000",
        "optim.warmup_steps=2",
        "logger=none",
        "logger.log_every=1",
        "checkpoint.every=0",
        "checkpoint.save_final=false",
        "dist.timeout_s=12",
    )
    wait_for_step(run, 3, proc)  # early: before rank 1's watchdog thread has published a heartbeat
    frozen = rank_process(run, 1)
    assert frozen is not None, "no rank 1 process"
    frozen.suspend()
    t0 = time.monotonic()
    try:
        while not (run / "hang.json").exists() and time.monotonic() - t0 < 60:
            time.sleep(0.5)
        named = time.monotonic() - t0
    finally:
        frozen.kill()  # torchrun's SIGTERM cannot end a stopped process; a real node's would be fenced
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_HANG and 12 <= named < 12 + 10, (named, err[-3000:])
    hang = json.loads((run / "hang.json").read_text())
    assert hang["silent"] == [1] and hang["frozen"] == [1], hang  # named by its heartbeat, not its step
    assert re.search(
        r"hang: no progress for \d+s \(dist\.timeout_s=12\) in step \d+; silent: rank\(s\) 1; .*"
        r"rank 1 no heartbeat for \d+s \(process stopped or gone; last: ",
        err,
    ), err[-2000:]
    assert "(none from the stopped rank(s) 1)" in err and not (run / "hang" / "rank1.txt").exists()
    assert (run / "hang" / "rank0.txt").exists()


# ----------------------------------------------------------------------------- 4. disks
@pytest.fixture
def small_disk(tmp_path):
    """A real, small filesystem (tmpfs) for the checkpoints. Needs root to mount."""
    mount = tmp_path / "disk"
    mount.mkdir()
    size = {"mb": 40}

    def make(mb: int) -> Path:
        size["mb"] = mb
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mb}m", "tmpfs", str(mount)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
        return mount

    yield make
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_too_little_disk_is_refused_before_the_run(small_disk, tmp_path, capsys, monkeypatch):
    from launcher.launch import cli

    disk = small_disk(15)
    monkeypatch.chdir(tmp_path)
    code = cli.main(
        ["train", f"hydra.run.dir={tmp_path / 'run'}", f"checkpoint.dir={disk / 'ckpt'}", "checkpoint.keep=3"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "checkpoint.dir=" in err[0] and "GiB free" in err[0], err
    assert not (tmp_path / "run").exists()


def test_the_space_check_asks_for_keep_plus_one_checkpoints_of_16_bytes_per_parameter(small_disk, tmp_path):
    """The boundary, from the model's own parameters: the largest keep whose keep + 1
    checkpoints of 16 bytes per parameter fit on the disk passes, one more is refused."""
    import shutil

    from launcher import models
    from launcher.launch import cli
    from launcher.launch.rundir import prepare as rundir

    disk = small_disk(40)
    cfg, _, _ = cli.compose_config(["model=gpt_tiny", "checkpoint.every=1", f"checkpoint.dir={disk / 'ckpt'}"])
    each = 16 * sum(p.numel() for p in models.on_meta(cfg).parameters())
    keep = shutil.disk_usage(disk).free // each - 1
    assert keep >= 1, (each, shutil.disk_usage(disk).free)
    fits = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, keep=int(keep)))
    rundir.check_checkpoint_space(fits, tmp_path / "run")
    over = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, keep=int(keep) + 1))
    with pytest.raises(cli.C.ConfigError, match=f"{keep + 2} checkpoints at once \\(keep={keep + 1},"):
        rundir.check_checkpoint_space(over, tmp_path / "run")
    # A run that writes fewer checkpoints than keep + 1 needs room for those alone: two
    # (every=100 of 200 steps) fit where keep + 2 would not.
    short = dataclasses.replace(over, checkpoint=dataclasses.replace(over.checkpoint, every=cfg.train.steps // 2))
    assert rundir.checkpoints_written(short) == 2 and keep + 2 > 2
    rundir.check_checkpoint_space(short, tmp_path / "run")
    assert (
        rundir.checkpoints_written(
            dataclasses.replace(short, checkpoint=dataclasses.replace(short.checkpoint, every=0))
        )
        == 1
    )
    assert (
        rundir.checkpoints_written(
            dataclasses.replace(short, checkpoint=dataclasses.replace(short.checkpoint, every=cfg.train.steps // 2 - 1))
        )
        == 3
    )


@pytest.mark.parametrize(
    "saving",
    [["recipe=ddp"], ["recipe=fsdp"], ["recipe=fsdp", "checkpoint.async_save=true"]],
    ids=["ddp", "fsdp", "fsdp-async"],
)
def test_a_disk_that_fills_mid_run_stops_cleanly_and_keeps_the_last_checkpoint(saving, small_disk, tmp_path):
    """The whole run directory on a small disk that another file fills after step 10's
    checkpoint: the ranks stop at step 20's save, the launcher's last word is one line
    (exit 74) naming the folder, its free space and the last complete checkpoint, although
    the ranks' report could not be written; free space, launch again, it resumes. fsdp with
    async saves: the write fails in the background; fsdp either way: inside DCP, which reports
    it as its CheckpointException (a BaseException holding each rank's error). The relaunch
    after freeing space runs once, for fsdp-async (the resume itself is the same for all three)."""
    disk = small_disk(40)
    run = disk / "run"
    args = [
        "train.steps=30",
        "optim.warmup_steps=2",
        "logger=none",
        "logger.log_every=1",
        "checkpoint.every=10",
        "checkpoint.keep=1",
        *saving,
    ]
    proc = start(run, *args)
    wait_for_step(run, 12, proc)
    filler = disk / "filler"
    with open(filler, "wb") as f:  # another process fills the disk
        try:
            while True:
                f.write(b"\0" * 2**20)
        except OSError:
            pass
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == EXIT_CHECKPOINT_FAILED, err[-3000:]
    # the rank's own line (torch's zip writer says only "unexpected pos 64 vs 0")
    assert re.search(r"checkpoint at step 20 could not be written on rank \d: no space left on device", err), err[
        -3000:
    ]
    if "checkpoint.async_save=true" in saving:
        assert "step_00000010 written in the background" in out, out[-2000:]
    last = err.strip().splitlines()[-1]
    ckpts = run / "checkpoints"
    assert last.startswith(f"error: a checkpoint could not be written in {ckpts} (no space left on device"), last
    assert "MiB free there" in last and f"the last complete checkpoint, {ckpts / 'step_00000010'}, is untouched" in last
    assert (
        "Expecting value" not in err and "Traceback" not in err and "ChildFailedError" not in err
    )  # torchrun's: its log
    assert verify(ckpts / "step_00000010") is None
    assert not list(ckpts.glob("*.tmp")), "the partial save was left behind"
    filler.unlink()
    if "checkpoint.async_save=true" not in saving:
        return
    proc = launch(*args, run_dir=run)
    assert "at step 10 " in proc.stdout
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 31))  # whole rows, each step once


@pytest.mark.parametrize("saving", ["sync", "async"])
def test_a_checkpoint_folder_that_vanishes_stops_with_the_ranks_cause(saving, tmp_path):
    """The checkpoint folder is replaced by a file mid-run (a cleanup script, an unmounted
    volume): rank 0's save fails, it leaves checkpoint_failed.json with the cause, and the
    launcher's last line (exit 74) gives that cause, which only the rank knew. async: the
    folder goes while step 10's files wait in host memory (held back 3 s); the writer
    thread's failure reaches the loop, which leaves the same marker."""
    run = tmp_path / "run"
    args = ["train.steps=30", "optim.warmup_steps=2", "logger=none", "logger.log_every=1", "checkpoint.every=10"]
    if saving == "async":
        args += ["checkpoint.async_save=true", "debug.async_save_delay_s=3"]
    proc = start(run, *args)
    ckpts = run / "checkpoints"
    if saving == "sync":
        wait_for_step(run, 12, proc)
    else:
        deadline = time.monotonic() + 120
        while not (ckpts / "step_00000010.tmp").exists():  # staged; the write waits 3 s
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.01)
    ckpts.rename(run / "moved")
    ckpts.write_text("not a folder\n")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_CHECKPOINT_FAILED and "Traceback" not in err, err[-3000:]
    failed = json.loads((run / "checkpoint_failed.json").read_text())
    cause = failed["cause"]
    if saving == "sync":
        assert cause.startswith("[Errno 17] File exists") and str(ckpts) in cause, cause
    else:
        assert failed["step"] == 10 and cause.startswith("[Errno 20] Not a directory") and str(ckpts) in cause, failed
        assert "checkpoint.async_save: " in out and "written in the background" not in out, out[-2000:]
        assert not (run / "moved" / "step_00000010").exists()
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: a checkpoint could not be written in {ckpts} ({cause}; "), last


# ----------------------------------------------------------------------------- security
def test_secrets_never_land_on_disk_and_metacharacters_in_a_run_name_run_nothing(tmp_path):
    """One run, two checks: secrets planted in its environment are in none of its files (the
    W&B run file too) nor its console; a run name (and run directory) full of shell
    metacharacters trains, and running its command.sh again creates no file."""
    secrets = {
        "WANDB_API_KEY": "planted-wandb-key-93f1c2",
        "HF_TOKEN": "planted-hf-token-5a7e",
        "DB_PASSWORD": "planted-password-77aa",
        "MY_SECRET": "planted-secret-1234",
    }
    name = "x; touch pwned1 $(touch pwned2) `touch pwned3` 'q' \"dq\""
    run = tmp_path / name
    # Quoted for Hydra's override grammar, as a user types it: run_name='x; touch pwned'
    quoted = lambda v: "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"  # noqa: E731
    proc = launch(
        "train.steps=2",
        "optim.warmup_steps=1",
        "logger=wandb",
        "logger.mode=offline",
        f"run_name={quoted(name)}",
        f"hydra.run.dir={quoted(str(run))}",
        env=secrets,
    )
    assert run.is_dir() and (run / "command.sh").exists()
    files = [p for p in run.rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files)
    for value in secrets.values():
        assert value not in proc.stdout + proc.stderr
        for p in files:
            assert value.encode() not in p.read_bytes(), f"{value} found in {p}"
    # Running the exact command again (it resumes a finished run) must not run the name either.
    again = subprocess.run(["bash", str(run / "command.sh")], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert not list(tmp_path.rglob("pwned*")) and not list(REPO.glob("pwned*")), proc.stdout

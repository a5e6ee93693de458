"""Trust, second pass (issue 47): each harm reproduced with the user's own commands, real
launches; docs/reliability.md section 12 names these tests."""

from __future__ import annotations

import os
import shutil
import signal

import pytest
from corpus import documents, write_jsonl
from runs import assert_refused, here, launch, rank_process, start, wait_for_step

from launcher.config import load_frozen
from launcher.manifest import read_latest, run_of, verify

pytestmark = pytest.mark.slow

SHORT = ["optim.warmup_steps=1", "logger=none", "logger.log_every=1"]


def flip_a_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the digests tell
    path.write_bytes(bytes(data))


def test_keep_k_never_deletes_the_good_checkpoints_after_a_corrupt_one_is_skipped(tmp_path):
    """Steps 2 and 4 kept, a byte of step 4 flipped. The relaunch to 4 no longer believes
    step 4 (it said "nothing to train"); killed right after `latest` moved to step 2 (the
    kill-in-save table's point for this sequence: debug.fault=resume_latest_moved), the
    folder still holds a verified checkpoint that `latest` names. The issue's relaunch
    (steps=6, stop_at=3, keep=1) sets step 4 aside, resumes from 2, saves 3 and keeps it;
    the relaunch to 6 resumes from 3 (it trained from 0, silently)."""
    run = tmp_path / "run"
    launch("train.steps=4", "checkpoint.every=2", "checkpoint.keep=2", *SHORT, run_dir=run)
    ckpts = run / "checkpoints"
    flip_a_byte(ckpts / "step_00000004" / "engine" / "model.pt")

    killed = launch(
        "train.steps=4",
        "checkpoint.every=2",
        "checkpoint.keep=2",
        *SHORT,
        "debug.fault=resume_latest_moved",
        "debug.fault_step=2",
        "debug.fault_rank=0",
        run_dir=run,
        check=False,
    )
    assert "nothing to train" not in killed.stdout and killed.returncode != 0, killed.stdout[-2000:]
    assert "injected fault resume_latest_moved at step 2" in killed.stderr, killed.stderr[-2000:]
    assert "step_00000004 fails its check (engine/model.pt fails its sha256)" in killed.stdout, killed.stdout[-2000:]
    assert read_latest(ckpts)[0] == "step_00000002" and verify(ckpts / "step_00000002") is None

    stopped = launch("train.steps=6", "train.stop_at=3", "checkpoint.every=2", "checkpoint.keep=1", *SHORT, run_dir=run)
    assert "step_00000004 skipped: engine/model.pt fails its sha256" in stopped.stderr, stopped.stderr[-2000:]
    assert "at step 2 " in stopped.stdout and "set aside as step_00000004.failed" in stopped.stdout
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000003", "step_00000004.failed"]
    assert read_latest(ckpts)[0] == "step_00000003" and verify(ckpts / "step_00000003") is None

    done = launch("train.steps=6", "checkpoint.every=2", "checkpoint.keep=1", *SHORT, run_dir=run)
    assert "at step 3 " in done.stdout, done.stdout[-2000:]
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000004.failed", "step_00000006"]


def test_no_command_moves_a_live_runs_checkpoints(tmp_path, monkeypatch):
    """Run A trains with checkpoint.every=4. Each command pointed at A's checkpoint folder with
    checkpoint.resume=never checkpoint.on_existing=archive, against the live run: train and
    submit (a stub sbatch on PATH: submit exited 0 and moved them) are refused in one line
    naming A's launch; export and data move nothing. A ends as it would have, its checkpoints
    and run id untouched."""
    run, other = tmp_path / "A", tmp_path / "B"
    live = start(run, "train.steps=100000", "checkpoint.every=4", *SHORT)
    try:
        wait_for_step(run, 6, live)
        ckpts = run / "checkpoints"
        owner = read_latest(ckpts)[1]
        archive = [f"checkpoint.dir={ckpts}", "checkpoint.resume=never", "checkpoint.on_existing=archive", *SHORT]
        stub = tmp_path / "bin"
        stub.mkdir()
        (stub / "sbatch").write_text("#!/bin/sh\necho 4242\n")
        (stub / "sbatch").chmod(0o755)
        env = {"PATH": f"{stub}:{os.environ['PATH']}"}
        for command, extra in (("train", []), ("submit", ["cluster.requeue=false"])):
            proc = launch(*archive, *extra, run_dir=other, command=command, env=env, check=False)
            assert_refused(
                proc.returncode, proc.stdout, proc.stderr, [f"{ckpts} is in use by the launch", f"pid {live.pid}"]
            )
            assert not other.exists() and not (ckpts / "archive").exists(), command
        assert launch(str(run), command="export", check=False).returncode == 0
        corpus = write_jsonl(tmp_path / "c.jsonl", documents(40))
        monkeypatch.setenv("HOME", str(tmp_path))  # the shared cache under this home
        here("data", f"data.files={corpus}", "data.tokenizer=byte", *archive[:3])
        assert read_latest(ckpts)[1] == owner and not (ckpts / "archive").exists()
    finally:
        live.send_signal(signal.SIGINT)
        live.communicate(timeout=120)
    assert live.returncode == 130 and not (ckpts / "archive").exists()
    assert all(run_of(f) == owner for f in ckpts.glob("step_*"))


@pytest.fixture(scope="module")
def typed(tmp_path_factory):
    """A 2-step run whose checkpoint.dir and run_name hold an escaped `${...}`."""
    tmp = tmp_path_factory.mktemp("typed")
    launch(
        "train.steps=2",
        *SHORT,
        rf"checkpoint.dir={tmp}/ck_\${{oc.env:SUB}}",
        r"run_name='\${oc.env:SECRET}'",
        run_dir=tmp / "run",
        env={"SUB": "sub", "SECRET": "planted-secret-81f2"},
    )
    return tmp


def test_a_config_value_reaches_the_ranks_as_typed(typed):
    """`checkpoint.dir='/x/ck_\\${oc.env:SUB}'` (the user's escaped `${`): the launcher locked,
    checked and settled the literal path while the ranks, resolving config.yaml again, wrote
    to /x/ck_<value of SUB>, which nothing locked; `run_name='\\${oc.env:SECRET}'` read back
    as the secret. Now config.yaml holds the characters typed and the ranks write where the
    launcher checked."""
    assert (typed / "ck_${oc.env:SUB}" / "step_00000002").is_dir() and not (typed / "ck_sub").exists()
    frozen = load_frozen(typed / "run")  # what every rank reads
    assert frozen.run_name == "${oc.env:SECRET}" and frozen.checkpoint.dir == f"{typed}/ck_${{oc.env:SUB}}"


def test_export_writes_where_its_command_line_says_only(typed, tmp_path):
    """A copied run directory whose config.yaml says export.out=<another folder>: `launcher
    export RUN` overwrote the model there; now it writes into the run's own export folder,
    and where the command line says."""
    run, victim = shutil.copytree(typed / "run", tmp_path / "run"), tmp_path / "theirs"
    victim.mkdir()
    (victim / "model.safetensors").write_bytes(b"their model")
    frozen = (run / "config.yaml").read_text()
    assert "  out: null" in frozen
    (run / "config.yaml").write_text(frozen.replace("  out: null", f"  out: {victim}"))
    assert here("export", str(run)).stdout.startswith(f"exported {run / 'export' / 'step_00000002'}")
    assert (victim / "model.safetensors").read_bytes() == b"their model"
    mine = tmp_path / "mine"
    here("export", str(run), f"export.out={mine}")
    assert (mine / "model.safetensors").is_file()


def test_a_symlink_inside_a_checkpoint_is_refused_in_one_line(typed, tmp_path):
    """The checkpoint's engine/ folder replaced by a link to a folder whose model.pt holds a
    payload (digests rewritten): the launch-side walk skipped it and the ranks refused with
    a traceback, exit 1; now one line, exit 2, the payload never run, no rank started."""
    import torch
    from crafted import Payload

    from launcher.manifest import write_manifest

    run = shutil.copytree(typed / "run", tmp_path / "run")
    ckpts = shutil.copytree(typed / "ck_${oc.env:SUB}", tmp_path / "ck")
    frozen = (run / "config.yaml").read_text().replace(str(typed / "ck_\\${oc.env:SUB}"), str(ckpts))
    (run / "config.yaml").write_text(frozen)
    step = ckpts / "step_00000002"
    elsewhere, marker = tmp_path / "elsewhere", tmp_path / "ran"
    shutil.move(step / "engine", elsewhere)
    state = torch.load(elsewhere / "model.pt", weights_only=True)
    state["payload"] = Payload(marker)
    torch.save(state, elsewhere / "model.pt")
    (step / "engine").symlink_to(elsewhere, target_is_directory=True)
    write_manifest(step, 2, run_of(step))
    proc = launch("train.steps=4", *SHORT, f"checkpoint.dir={ckpts}", run_dir=run, check=False)
    assert_refused(
        proc.returncode, proc.stdout, proc.stderr, [f"{step / 'engine'} is a symbolic link", "must never run code"]
    )
    assert not marker.exists() and "rank(s) on" not in proc.stdout


def test_a_rank_killed_by_a_signal_is_named_in_one_line(tmp_path):
    """A rank SIGKILLed mid-run (what the kernel's out-of-memory killer does): the user got
    torchrun's traceback and failure table, the surviving rank's gloo errors and exit 1.
    Now one line names the rank, the signal and the likely cause (the host's memory beside
    the rank's own peak), and what resumes the run; the rest is in RUN_DIR/torchrun.log."""
    run = tmp_path / "run"
    proc = start(run, "train.steps=100000", "checkpoint.every=3", *SHORT, split_stderr=True)
    wait_for_step(run, 4, proc)
    victim = rank_process(run, 1)
    victim.kill()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGKILL, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: rank 1 (pid {victim.pid}) was killed by SIGKILL: "), err
    assert "GiB available in the seconds before; its peak resident memory" in lines[0], lines[0]
    assert lines[0].endswith("step_00000003, is untouched. Launch the same run directory again to resume from it.")
    assert "Traceback" not in out and "ChildFailedError" in (run / "torchrun.log").read_text()

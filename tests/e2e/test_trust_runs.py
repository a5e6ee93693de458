"""Trust, second pass (issue 47): each harm reproduced with the user's own commands, real
launches; docs/reliability.md section 12 names these tests."""

from __future__ import annotations

import pytest

from runs import launch
from launcher.manifest import read_latest, verify

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

    killed = launch("train.steps=4", "checkpoint.every=2", "checkpoint.keep=2", *SHORT,
                    "debug.fault=resume_latest_moved", "debug.fault_step=2", "debug.fault_rank=0", run_dir=run,
                    check=False)
    assert "nothing to train" not in killed.stdout and killed.returncode != 0, killed.stdout[-2000:]
    assert "injected fault resume_latest_moved at step 2" in killed.stderr, killed.stderr[-2000:]
    assert "step_00000004 fails its check (engine/model.pt fails its sha256)" in killed.stdout, killed.stdout[-2000:]
    assert read_latest(ckpts)[0] == "step_00000002" and verify(ckpts / "step_00000002") is None

    stopped = launch("train.steps=6", "train.stop_at=3", "checkpoint.every=2", "checkpoint.keep=1", *SHORT,
                     run_dir=run)
    assert "step_00000004 skipped: engine/model.pt fails its sha256" in stopped.stderr, stopped.stderr[-2000:]
    assert "at step 2 " in stopped.stdout and "set aside as step_00000004.failed" in stopped.stdout
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000003", "step_00000004.failed"]
    assert read_latest(ckpts)[0] == "step_00000003" and verify(ckpts / "step_00000003") is None

    done = launch("train.steps=6", "checkpoint.every=2", "checkpoint.keep=1", *SHORT, run_dir=run)
    assert "at step 3 " in done.stdout, done.stdout[-2000:]
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000004.failed", "step_00000006"]

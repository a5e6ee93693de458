"""A checkpoint is data, never code: crafted files are refused by export and resume in one
line, before anything in them runs (launcher/untrusted.py, launcher/parallel/dcp.py's SafeReader,
DeepSpeed under forced weights_only). Each crafted file would run a command (touch a
marker) if unpickled; the manifest's digests are rewritten to match, as an attacker would."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from crafted import Payload, craft_metadata
from runs import FAST, REPO, launch

from launcher.manifest import files_of, verify, write_manifest, writer_of


# ----------------------------------------------------------------------------- real runs
def crafted(run: Path, tmp: Path, recipe: str) -> tuple[Path, Path]:
    """A copy of `run` whose checkpoint holds a payload in the file each recipe's loader reads
    first (DCP: .metadata; DeepSpeed: its model states file; "trainer": rank 0's trainer
    state, which every recipe reads), digests rewritten."""
    bad, marker = tmp / f"{recipe}-crafted", tmp / f"{recipe}-ran"
    shutil.copytree(run, bad)
    step = sorted((bad / "checkpoints").glob("step_*"))[-1]
    engine = step / "engine"
    if recipe in ("zero2", "trainer"):
        target = (
            step / "trainer" / "rank_00000.pt"
            if recipe == "trainer"
            else sorted((engine / "ds").glob("*model_states.pt"))[0]
        )
        state = torch.load(target, map_location="cpu", weights_only=False)  # our own file, just written
        state["payload"] = Payload(marker)
        torch.save(state, target)
    else:
        craft_metadata(engine, marker)
    write_manifest(step, int(step.name.split("_")[1]))
    return bad, marker


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["fsdp", "zero2"])
def test_export_and_resume_refuse_a_crafted_checkpoint(recipe, tmp_path):
    run = tmp_path / "run"
    launch(
        f"recipe={recipe}",
        "cluster.nproc_per_node=2",
        *FAST,
        "train.steps=2",
        "optim.warmup_steps=1",
        "logger=none",
        run_dir=run,
    )
    assert launch(str(run), command="export", check=False).returncode == 0  # the genuine run exports
    # Its manifest was gathered from both ranks' digests, each rank hashing the files it
    # wrote: every file listed and right, and each rank's share a good part of the bytes.
    genuine = sorted((run / "checkpoints").glob("step_*"))[-1]
    files = json.loads((genuine / "manifest.json").read_text())["files"]
    assert sorted(files) == files_of(genuine) and verify(genuine) is None
    shares = [sum(m["size"] for rel, m in files.items() if writer_of(rel, 2) == r) for r in (0, 1)]
    assert min(shares) > 0.3 * sum(shares), shares
    assert all(m["by"] == writer_of(rel, 2) for rel, m in files.items()), files  # hashed by their writers
    bad, marker = crafted(run, tmp_path, recipe)

    export = launch(str(bad), command="export", check=False)
    resume = launch(
        f"recipe={recipe}", "cluster.nproc_per_node=2", *FAST, "train.steps=4", "logger=none", run_dir=bad, check=False
    )
    for proc in (export, resume):
        assert proc.returncode == 2, proc.stderr[-3000:]
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "must never run code" in lines[0], proc.stderr[-3000:]
    assert not marker.exists()
    assert len((bad / "metrics.jsonl").read_text().splitlines()) == len(
        (run / "metrics.jsonl").read_text().splitlines()
    )

    # The ranks' own loaders refuse it too, without the launch side's check.
    import engines
    from launcher.config import load_frozen, to_yaml

    cfg = load_frozen(bad / "config.yaml")
    engine = sorted((bad / "checkpoints").glob("step_*"))[-1] / "engine"
    with pytest.raises(BaseException) as refused:
        engines.consolidate(cfg, engine)
    why = str(getattr(refused.value, "failures", refused.value))
    assert "must never run code" in why or "Weights only load failed" in why, why
    assert not marker.exists()

    # The trainer state (trainer/rank_R.pt, the same for every recipe): refused by export and
    # resume, and by the rank itself, started by hand without the launch side's check.
    if recipe != "fsdp":
        return
    bad, marker = crafted(run, tmp_path, "trainer")
    for proc in (
        launch(str(bad), command="export", check=False),
        launch(
            f"recipe={recipe}",
            "cluster.nproc_per_node=2",
            *FAST,
            "train.steps=4",
            "logger=none",
            run_dir=bad,
            check=False,
        ),
    ):
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and "must never run code" in lines[0], proc.stderr[-3000:]
    cfg.train.steps = 4  # a step to train, so the rank loads the checkpoint
    (bad / "config.yaml").write_text(to_yaml(cfg))
    by_hand = subprocess.run(
        [sys.executable, "-m", "launcher.rank", str(bad)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert by_hand.returncode != 0 and "Weights only load failed" in by_hand.stderr, by_hand.stderr[-3000:]
    assert not marker.exists()

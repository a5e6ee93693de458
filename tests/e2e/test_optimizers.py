"""The optimizers of launcher/optim/ on real ranks: each under fsdp as under ddp and resumed
exactly from both engines' checkpoints (one probe process group), adamw8bit through the
launcher under fsdp with a resume, muon under ddp; metrics.jsonl read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from runs import REPO, launch, read_metrics

from launcher.launch import cli
from launcher.planner import plan as planner

COMMON = (
    "model=gpt_tiny",
    "train.steps=8",
    "optim.warmup_steps=2",
    "logger=none",
    "logger.log_every=1",
    "train.micro_batch=4",
    "train.seq_len=64",
    "cluster.nproc_per_node=2",
)


@pytest.mark.slow
def test_each_optimizer_shards_and_resumes_exactly(tmp_path):
    """tests/helpers/optim_probe.py: per optimizer, a ddp and an fsdp engine on the same 2
    ranks and batches; after 3 steps their held-out losses agree within 1e-4 (Adafactor's
    and Muon's sharded matrices stepped whole); a 4th step after save and load into a new
    engine (ddp's model.pt/optim.pt, fsdp's DCP) gives the same weights as the 4th step of
    the engine that saved, exactly (the low-bit moments come back with the same codes and
    scales)."""
    out = tmp_path / "probe.json"
    names = ["adamw8bit", "adamw4bit", "adafactor", "muon"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "tests/helpers/optim_probe.py",
            str(out),
            *names,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    found = json.loads(out.read_text())
    assert set(found) == set(names)
    for name, r in found.items():
        assert r["fsdp_vs_ddp"] < 1e-4, (name, r)
        assert r["ddp_resumed"] == 0.0 and r["fsdp_resumed"] == 0.0, (name, r)


def planned_optim(*overrides: str) -> int:
    cfg, _, _ = cli.compose_config(["model=gpt_tiny", *overrides])
    layout = next(
        lay
        for lay in planner.candidates(
            cfg, planner.Hardware(0, 2, 1, planner.DEFAULT_TFLOPS), {cfg.recipe.name: cfg.recipe}
        )
        if lay.recipe == cfg.recipe.name
    )
    return planner.model_states(cfg, layout)[2]


@pytest.mark.slow
def test_adamw8bit_under_fsdp_learns_and_resumes(run_dir):
    """Two launches (to step 4, then on to 8 from its checkpoint): the loss falls, and the
    optimizer states each rank reports (mem/optim_bytes) are the planner's adamw8bit bytes
    (within 2%), at most 0.3x its adamw bytes."""
    first = launch(*COMMON, "recipe=fsdp", "optim=adamw8bit", "train.stop_at=4", run_dir=run_dir)
    second = launch(*COMMON, "recipe=fsdp", "optim=adamw8bit", run_dir=run_dir)
    assert "resumed from" in second.stdout and "resumed" not in first.stdout
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert rows[-1]["loss"] < 0.95 * rows[0]["loss"], [r["loss"] for r in rows]
    held = rows[-1]["mem/optim_bytes"]
    assert abs(held / planned_optim("recipe=fsdp", "optim=adamw8bit") - 1) < 0.02
    assert held <= 0.3 * planned_optim("recipe=fsdp", "optim=adamw")


@pytest.mark.slow
def test_muon_under_ddp_learns(run_dir):
    launch(*COMMON, "recipe=ddp", "optim=muon", run_dir=run_dir)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert rows[-1]["loss"] < 0.95 * rows[0]["loss"], [r["loss"] for r in rows]
    assert abs(rows[-1]["mem/optim_bytes"] / planned_optim("recipe=ddp", "optim=muon") - 1) < 0.02

"""train.eval_every: the held-out loss, through real launches on 2 gloo ranks. The same
training evaluated by four engines (ddp; fsdp, stopped at an evaluation and resumed; zero3;
a 2-stage pipeline) gives the same val/loss, so each engine's forward-only pass
(Engine.eval_step) evaluates the whole model on the same held-out samples; the resumed
run evaluates each step once. Held-out windows of a token file: tests/unit/test_held_out.py."""

from __future__ import annotations

import json
import math

import pytest

from runs import launch, read_metrics

pytestmark = pytest.mark.slow

COMMON = ["model=gpt_tiny", "train.steps=10", "optim.warmup_steps=2", "logger=none", "logger.log_every=5",
          "train.eval_every=5", "train.eval_samples=16", "train.micro_batch=4", "train.global_batch=8", "checkpoint.every=0"]


def _evaluated(run) -> dict[int, float]:
    rows = [r for r in read_metrics(run) if "val/loss" in r]
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), f"a step evaluated twice: {steps}"
    for r in rows:
        assert r["val/perplexity"] == pytest.approx(math.exp(r["val/loss"]), rel=1e-9)
    return {r["step"]: r["val/loss"] for r in rows}


def test_every_engine_evaluates_the_same_held_out_loss(tmp_path):
    ddp = tmp_path / "ddp"
    launch("recipe=ddp", *COMMON, run_dir=ddp)
    reference = _evaluated(ddp)
    assert sorted(reference) == [5, 10] and reference[10] < reference[5]
    summary = json.loads((ddp / "summary.json").read_text())
    assert (summary["val_loss"], summary["val_step"]) == (reference[10], 10)

    fsdp = tmp_path / "fsdp"  # stopped right after the evaluation at step 5, then resumed
    launch("recipe=fsdp", *COMMON, "train.stop_at=5", run_dir=fsdp)
    launch("recipe=fsdp", *COMMON, run_dir=fsdp)
    pipeline = tmp_path / "pp"
    launch("recipe=pp", "parallel.pp=2", "parallel.pp_microbatches=2", *COMMON, run_dir=pipeline)  # 1 x 2 accum
    zero3 = tmp_path / "zero3"
    launch("recipe=zero3", *COMMON, run_dir=zero3)
    for run in (fsdp, pipeline, zero3):
        got = _evaluated(run)
        assert sorted(got) == [5, 10], (run.name, got)
        for step, value in reference.items():
            assert got[step] == pytest.approx(value, rel=2e-4), (run.name, step, got[step], value)

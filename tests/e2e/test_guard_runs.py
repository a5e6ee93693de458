"""The loss guard on real ranks (train.max_bad_steps, train.spike_factor): a NaN and a spike
injected through debug.fault (nan_loss, spike) are skipped without an optimizer update,
bad steps in a row send the weights back to the newest checkpoint, and the run ends with
a finite loss, the skips in metrics.jsonl, summary.json and the W&B run file."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import wandb_file
from runs import launch, read_metrics

SHORT = ["optim.warmup_steps=2", "logger.log_every=1", "train.max_bad_steps=2"]


def same(a, b) -> bool:
    """Two nested state dicts hold equal tensors and values."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.slow
def test_nan_steps_are_skipped_then_the_weights_go_back_to_the_last_checkpoint(run_dir):
    """ddp, 12 steps, checkpoints every 4; rank 1's loss is NaN at steps 7 and 8. Both are
    skipped; after the second the weights and optimizer state go back to step 4's, so the
    checkpoint saved at step 8 holds step 4's weights, with the data position of step 8."""
    proc = launch(
        *SHORT,
        "train.steps=12",
        "checkpoint.every=4",
        "logger.mode=offline",
        "logger.system_metrics_s=0",
        "debug.fault=nan_loss",
        "debug.fault_rank=1",
        "debug.fault_step=7",
        "debug.fault_steps=2",
        run_dir=run_dir,
    )
    out = proc.stdout
    assert "loss guard: step 7 skipped (gradient norm nan); 1 in a row" in out, out[-3000:]
    assert "loss guard: step 8 skipped (gradient norm nan); 2 in a row" in out
    assert (
        f"loss guard: 2 bad steps in a row; weights and optimizer state back to "
        f"{run_dir / 'checkpoints' / 'step_00000004'} (step 4), going on from step 9"
    ) in out

    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 13))  # the step number goes on
    assert [r["step"] for r in rows if not math.isfinite(r["loss"])] == [7, 8]
    assert (rows[-1]["guard/skipped_steps"], rows[-1]["guard/rollbacks"]) == (2, 1)
    assert rows[-1]["loss"] < rows[0]["loss"]
    lrs = [r["lr"] for r in rows[2:]]  # after the 2 warm-up steps the cosine only falls: no step back at the rollback
    assert all(a > b for a, b in zip(lrs, lrs[1:])), lrs

    ckpts = run_dir / "checkpoints"
    at4 = torch.load(ckpts / "step_00000004" / "engine" / "model.pt", weights_only=True)
    at8 = torch.load(ckpts / "step_00000008" / "engine" / "model.pt", weights_only=True)
    assert same(at4, at8), "step 8's checkpoint does not hold step 4's weights"
    opt4, opt8 = (
        torch.load(ckpts / f"step_0000000{s}" / "engine" / "optim.pt", weights_only=True)["optimizer"] for s in (4, 8)
    )
    assert same(opt4["state"], opt8["state"]), "step 8's checkpoint does not hold step 4's Adam state"
    # ... but the learning rate the schedule gives step 8, not step 4's that the optimizer's state brought back
    assert [g["lr"] for g in opt8["param_groups"]] == [rows[7]["lr"]] * len(opt8["param_groups"])
    assert rows[7]["lr"] != rows[3]["lr"]
    state = torch.load(ckpts / "step_00000008" / "trainer" / "rank_00000.pt", weights_only=True)
    assert (state["step"], state["samples_seen"]) == (8, 8 * 16)  # past the bad batches
    at12 = torch.load(ckpts / "step_00000012" / "engine" / "model.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in at12.values()) and not same(at8, at12)

    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["guard_skipped_steps"], summary["guard_rollbacks"]) == (2, 1)
    assert math.isfinite(summary["final_loss"])
    runs = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    history = {h["_step"]: h for h in wandb_file.history(runs[0])}
    assert sorted(history) == list(range(1, 13))
    assert [history[s]["guard/skipped_steps"] for s in (6, 7, 8, 12)] == [0, 1, 2, 2]
    assert [history[s]["guard/rollbacks"] for s in (8, 9, 12)] == [0, 1, 1]  # step 8 logs before it goes back


def zero_state(step: Path) -> dict:
    from launcher.untrusted import weights_only_loads

    with weights_only_loads():
        model = torch.load(step / "engine" / "ds" / "mp_rank_00_model_states.pt", weights_only=True)["module"]
        optim = [
            torch.load(f, weights_only=True)["optimizer_state_dict"]
            for f in sorted((step / "engine" / "ds").glob("zero_pp_rank_*_optim_states.pt"))
        ]
    # each rank's Adam state and fp32 master partition (not the learning rate, which goes
    # on, nor DeepSpeed's overflow flag, which records the skip)
    return {
        "model": model,
        "optim": [(o["base_optimizer_state"]["state"], o["single_partition_of_fp32_groups"]) for o in optim],
    }


def dcp_state(step: Path, tmp: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(step / "engine", tmp / f"{step.name}.pt")
    state = torch.load(tmp / f"{step.name}.pt", weights_only=True)
    # the Adam state, flattened by name (not the param groups' learning rate: it goes on)
    return {"model": state["model"], "optim": {k: v for k, v in state["optim"].items() if k.startswith("state.")}}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["zero2", "pp"])
def test_a_spike_is_skipped_without_an_update_under_deepspeed_and_a_pipeline(recipe, run_dir, tmp_path):
    """Rank 1's loss (zero2) or its last stage's logits (pp) x 1000 at step 10 of 10: a
    spike against the mean of the 9 steps before, skipped. DeepSpeed skips it through the
    NaN the guard puts into the last backward, the pipeline before its optimizer step: the
    checkpoints of steps 9 and 10 hold the same weights and optimizer state."""
    proc = launch(
        *SHORT,
        f"recipe={recipe}",
        "train.steps=10",
        "checkpoint.every=1",
        "checkpoint.keep=2",
        "train.spike_factor=3",
        "logger=none",
        "debug.fault=spike",
        "debug.fault_rank=1",
        "debug.fault_step=10",
        run_dir=run_dir,
    )
    assert "loss guard: step 10 skipped (loss " in proc.stdout and "above train.spike_factor=3" in proc.stdout, (
        proc.stdout[-3000:]
    )
    rows = read_metrics(run_dir)
    assert rows[-1]["loss"] > 50 * rows[-2]["loss"]
    assert (rows[-1]["guard/skipped_steps"], rows[-1]["guard/rollbacks"]) == (1, 0)
    assert all(r["guard/skipped_steps"] == 0 for r in rows[:-1])
    ckpts = run_dir / "checkpoints"
    read = zero_state if recipe == "zero2" else (lambda step: dcp_state(step, tmp_path))
    at9, at10 = read(ckpts / "step_00000009"), read(ckpts / "step_00000010")
    assert same(at9, at10), "the skipped step changed the weights or the optimizer state"
    assert all(torch.isfinite(t).all() for t in (at10["model"].values()))

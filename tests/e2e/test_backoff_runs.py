"""train.oom_backoff: an out-of-memory in a step halves the micro-batch and doubles the
accumulation, so the global batch (and what the run learns) stays the same. Injected with
debug.fault=oom (torch.OutOfMemoryError at the end of a forward, once per run directory):
in place on one rank, by a relaunch from the last checkpoint on two."""

from __future__ import annotations

import pytest
import wandb_file
import yaml
from runs import assert_same_training, launch, read_metrics

COMMON = (
    "model=gpt_tiny",
    "recipe=ddp",
    "train.seq_len=64",
    "optim.warmup_steps=1",
    "logger.log_every=1",
    "checkpoint.every=2",
)


def frozen_batch(run_dir) -> tuple[int, int]:
    train = yaml.safe_load((run_dir / "config.yaml").read_text())["train"]
    return train["micro_batch"], train["grad_accum"]


@pytest.mark.slow
def test_one_rank_retries_the_step_in_place_and_trains_as_the_smaller_micro_batch_would(tmp_path):
    backed, straight = tmp_path / "backed", tmp_path / "straight"
    one = (*COMMON, "cluster.nproc_per_node=1", "train.steps=3")
    proc = launch(
        *one,
        "train.micro_batch=8",
        "train.oom_backoff=true",
        "debug.fault=oom",
        "debug.fault_step=1",
        "logger=wandb",
        "logger.mode=offline",
        run_dir=backed,
    )
    launch(*one, "train.micro_batch=4", "train.grad_accum=2", "logger=none", run_dir=straight)
    assert (
        "out of memory at step 1 with micro-batch 8 x 1 (injected by debug.fault=oom (micro-batch 8)): "
        "retrying the step with train.micro_batch=4, grad_accum 2 (the global batch kept)"
    ) in proc.stdout
    assert "Traceback" not in proc.stderr
    # The retried step is the step a run at micro-batch 4 x 2 takes: bit for bit, every step.
    assert_same_training(backed, straight, 3)
    assert frozen_batch(backed) == (4, 2)
    run_file = next((backed / "wandb").glob("offline-run-*/run-*.wandb"))
    train = wandb_file.config(run_file)["train"]
    assert (train["micro_batch"], train["grad_accum"]) == (4, 2)


@pytest.mark.slow
def test_two_ranks_relaunch_from_the_last_checkpoint_with_the_batch_kept(tmp_path):
    """Rank 1 runs out of memory in step 3: its peer waits inside the step's all-reduce, so
    the run ends and the launcher launches it again from step 2's checkpoint at 4 x 2. That
    is exactly a run trained to step 2 at 8 x 1 and resumed by hand at 4 x 2."""
    backed, by_hand = tmp_path / "backed", tmp_path / "by_hand"
    two = (*COMMON, "cluster.nproc_per_node=2", "train.steps=4")
    proc = launch(
        *two,
        "train.micro_batch=8",
        "train.oom_backoff=true",
        "debug.fault=oom",
        "debug.fault_step=3",
        "debug.fault_rank=1",
        "logger=wandb",
        "logger.mode=offline",
        run_dir=backed,
    )
    launch(*two, "train.micro_batch=8", "train.stop_at=2", "logger=none", run_dir=by_hand)
    launch(*two, "train.micro_batch=4", "train.grad_accum=2", "logger=none", run_dir=by_hand)
    assert (
        "out of memory on rank 1 at step 3 with micro-batch 8 x 1: launching again from the last checkpoint "
        "with train.micro_batch=4, grad_accum 2 (the global batch kept)"
    ) in proc.stdout
    assert "resumed from" in proc.stdout and "at step 2 (32 samples seen)" in proc.stdout
    assert "global batch 16 (4 x 2 accum x 2 dp)" in proc.stdout
    assert_same_training(backed, by_hand, 4)
    assert frozen_batch(backed) == (4, 2)
    assert not (backed / "oom.json").exists()
    # W&B: the relaunch resumed the same run id; its config says 4 x 2.
    runs = sorted((backed / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 2, (runs, proc.stdout[-3000:], proc.stderr[-3000:])
    first, again = runs
    assert wandb_file.run_info(first)["id"] == wandb_file.run_info(again)["id"]
    assert (wandb_file.config(first)["train"]["micro_batch"], wandb_file.config(again)["train"]["micro_batch"]) == (
        8,
        4,
    )
    assert wandb_file.config(again)["train"]["grad_accum"] == 2


@pytest.mark.slow
def test_a_deepspeed_run_relaunches_with_its_json_rebatched(tmp_path):
    """zero2 keeps the accumulation in DeepSpeed's own config: the relaunch rewrites
    ds_config.json beside config.yaml, and DeepSpeed trains on at 4 x 2."""
    run = tmp_path / "zero2"
    proc = launch(
        *COMMON,
        "recipe=zero2",
        "cluster.nproc_per_node=2",
        "train.steps=3",
        "logger=none",
        "train.micro_batch=8",
        "train.oom_backoff=true",
        "debug.fault=oom",
        "debug.fault_step=3",
        "debug.fault_rank=0",
        run_dir=run,
        timeout=600,
    )
    assert "launching again from the last checkpoint with train.micro_batch=4, grad_accum 2" in proc.stdout
    ds = yaml.safe_load((run / "ds_config.json").read_text())
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (
        4,
        2,
        16,
    )
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]

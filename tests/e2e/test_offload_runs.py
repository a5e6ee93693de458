"""train.activation_offload through the launcher: fsdp on two gloo ranks trains bit for bit
as without it, and the bytes its hooks moved in the measured step are the planner's host
activation bytes for that rank."""

from __future__ import annotations

import json

import pytest
from runs import launch, read_metrics

from launcher.config import ACMode
from launcher.launch import cli
from launcher.planner import plan as planner
from launcher.planner.footprint import activations

RUN = (
    "model=gpt_tiny",
    "precision=fp32",
    "recipe=fsdp",
    "cluster.nproc_per_node=2",
    "train.seq_len=128",
    "train.micro_batch=4",
    "train.steps=3",
    "optim.warmup_steps=1",
    "logger.log_every=1",
    "logger=none",
    "debug.final_digest=true",
    "train.activation_checkpointing=selective",
)


@pytest.mark.slow
def test_fsdp_with_activation_offload_trains_as_without_and_moves_what_the_plan_says(tmp_path):
    plain, offloaded = tmp_path / "plain", tmp_path / "offloaded"
    launch(*RUN, run_dir=plain)
    launch(*RUN, "train.activation_offload=true", "train.measure_activations=true", run_dir=offloaded)
    a, b = read_metrics(plain), read_metrics(offloaded)
    assert [r["loss"] for r in a] == [r["loss"] for r in b] and [r["grad_norm"] for r in a] == [
        r["grad_norm"] for r in b
    ]
    digests = [json.loads((d / "summary.json").read_text())["weights_digest_per_rank"] for d in (plain, offloaded)]
    assert digests[0] == digests[1] and None not in digests[0]
    cfg, _, _ = cli.compose_config([*RUN, "train.activation_offload=true"])
    layout = planner.layout_for(cfg, 2)
    host = activations(cfg, layout, ACMode.selective, 4, where="host")
    moved = next(r["mem/offloaded_activation_bytes"] for r in b if "mem/offloaded_activation_bytes" in r)
    assert abs(moved / host - 1) < 0.01, (moved, host)

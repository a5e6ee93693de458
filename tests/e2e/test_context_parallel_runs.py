"""parallel.cp through the launcher: the sequence split over gloo ranks trains as the whole
sequence does (loss and gradient norm to fp32 rounding), under fsdp, ddp and tp_fsdp, with
and without recomputation, grouped-query attention included (key/value heads that split
over cp and heads that do not); and the activation bytes a rank saves are the planner's,
half the cp=1 rank's."""

from __future__ import annotations

import pytest
from runs import launch, read_metrics

from launcher.launch import cli
from launcher.planner import plan as planner
from launcher.planner.footprint import activations

# gpt_tiny with 2 key/value heads for its 4 query heads; the same 16 sequences a step everywhere
COMMON = (
    "model=gpt_tiny",
    "model.n_kv_heads=2",
    "train.seq_len=128",
    "train.global_batch=16",
    "train.steps=3",
    "optim.warmup_steps=1",
    "logger=none",
    "logger.log_every=1",
    "checkpoint.save_final=false",
)
MEASURED = ("train.measure_activations=true", "train.activation_checkpointing=none")


def _activation_bytes(rows: list[dict]) -> int:
    return next(r["mem/activation_bytes"] for r in rows if "mem/activation_bytes" in r)


def _planned(overrides, world: int) -> int:
    cfg, _, _ = cli.compose_config([*overrides, "precision=fp32"])
    return activations(cfg, planner.layout_for(cfg, world), cfg.train.activation_checkpointing, cfg.train.micro_batch)


@pytest.mark.slow
def test_context_parallel_trains_as_the_whole_sequence_and_saves_half_the_activations(tmp_path):
    whole = (*COMMON, "recipe=fsdp", "train.micro_batch=8", *MEASURED)
    launch(*whole, run_dir=tmp_path / "cp1")
    base = read_metrics(tmp_path / "cp1")
    runs = {
        "fsdp_cp2": ((*COMMON, "recipe=fsdp", "parallel.cp=2", "train.micro_batch=8", *MEASURED), 2),
        "ddp_cp2_op": ((*COMMON, "recipe=ddp", "parallel.cp=2", "train.activation_checkpointing=op"), 2),
        # kv heads per tensor-parallel rank (1) do not split over cp=2: repeated before the all-to-all
        "tp_fsdp_tp2_cp2": (
            (*COMMON, "recipe=tp_fsdp", "parallel.tp=2", "parallel.cp=2", "cluster.nproc_per_node=4"),
            4,
        ),
    }
    for name, (overrides, _) in runs.items():
        out = launch(*overrides, run_dir=tmp_path / name).stdout
        assert "x cp 2 x" in out, out
        rows = read_metrics(tmp_path / name)
        assert len(rows) == len(base) == 3
        for a, b in zip(base, rows):
            assert abs(a["loss"] - b["loss"]) < 1e-4, (name, a["loss"], b["loss"])
            assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-4 * a["grad_norm"], (name, a["grad_norm"], b["grad_norm"])

    # what a rank saves: the planner's figure (within 1%), and half of the whole sequence's (within 15%)
    split = _activation_bytes(read_metrics(tmp_path / "fsdp_cp2"))
    full = _activation_bytes(base)
    assert abs(split / _planned(runs["fsdp_cp2"][0], 2) - 1) < 0.01, split
    assert abs(full / _planned(whole, 2) - 1) < 0.01, full
    assert abs(split / full - 0.5) < 0.5 * 0.15, (split, full)

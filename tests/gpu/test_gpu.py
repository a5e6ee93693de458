"""The GPU test set (`pytest -m gpu`; `make gpu-check` runs it and writes bench/gpu.md):
every recipe through the real launcher on CUDA with NCCL, at the world size this machine
allows (one GPU: every recipe that runs on one rank; the tensor- and pipeline-parallel
recipes need two GPUs and are skipped with that reason), in bf16 with activation
checkpointing and checkpoints; fp16 with its loss scaler; torch.compile; a resume; the
allocator's memory snapshot; and the planner's per-rank peak against CUDA's
max_memory_allocated for gpt_125m, gpt_350m and gpt_1b. Skipped without a CUDA GPU.
fp8 against bf16 is tests/gpu/test_fp8_seeds.py (two seeds each: the bound from bf16's own
spread; the single pair this file had failed a 2% bound that bf16 itself does not keep).

The runs are independent processes, so they start together (one GPU holds them all;
what they check is memory per process and correctness, not speed) and the tests read
what each left. GPU_CHECK_OUT=<dir> (set by make gpu-check) receives the measurements.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import time
from pathlib import Path

import pytest
import torch
from gpu_runs import GPUS, chosen, ended, finished, ran, record, schedule
from gpu_runs import start as _start
from runs import read_metrics

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="no CUDA GPU")]

STEPS = 8
SMALL = [
    "model=gpt_small",
    "train.seq_len=256",
    "train.micro_batch=8",
    f"train.steps={STEPS}",
    "optim.warmup_steps=2",
    "logger=none",
    "logger.log_every=1",
    "checkpoint.every=4",
    f"cluster.nproc_per_node={GPUS}",
]
# recipe -> its degrees on this machine (None: it cannot split one GPU)
SPLIT = 2 if GPUS >= 2 else None
RECIPES = {
    "ddp": [],
    "fsdp": [],
    "zero1": [],
    "zero2": [],
    "zero3": [],
    "zero2_offload": [],
    "zero3_offload": [],
    "tp": [f"parallel.tp={SPLIT}"] if SPLIT else None,
    "pp": [f"parallel.pp={SPLIT}"] if SPLIT else None,
    "tp_fsdp": [f"parallel.tp={SPLIT}"] if SPLIT and GPUS % SPLIT == 0 else None,
    "pp_fsdp": [f"parallel.pp={SPLIT}"] if SPLIT and GPUS >= 2 * SPLIT else None,
}
FP16 = ("ddp", "zero2", "zero3")  # the engines with an fp16 loss scaler (EngineSpec.fp16)
PLANNED_MODELS = ("gpt_125m", "gpt_350m", "gpt_1b")
PLANNED_RECIPES = ("ddp", "fsdp", "zero1", "zero2", "zero3")
PLANNED = [
    "train.seq_len=1024",
    "train.micro_batch=4",
    "precision=bf16",
    "train.steps=4",
    "optim.warmup_steps=1",
    "logger=none",
    "logger.log_every=1",
    "checkpoint.every=0",
    "checkpoint.save_final=false",
    f"cluster.nproc_per_node={GPUS}",
]


def cases() -> dict[str, list[str]]:
    """Every run of the set, by name: its overrides."""
    out = {}
    for recipe, degrees in RECIPES.items():
        if degrees is not None:
            out[f"{recipe}-bf16"] = [
                f"recipe={recipe}",
                *degrees,
                *SMALL,
                "precision=bf16",
                "train.activation_checkpointing=full",
            ]
    for recipe in FP16:
        out[f"{recipe}-fp16"] = [f"recipe={recipe}", *SMALL, "precision=fp16"]
    out["fsdp-fp16"] = ["recipe=fsdp", *SMALL, "precision=fp16"]  # refused: FSDP2 has no loss scaler here
    for recipe in ("ddp", "fsdp"):
        out[f"{recipe}-compile"] = [f"recipe={recipe}", *SMALL, "precision=bf16", "train.compile=true"]
    out["ddp-profiled"] = [
        "recipe=ddp",
        *(o for o in SMALL if not o.startswith("logger.log_every")),
        "logger.log_every=2",
        "precision=bf16",
        "profile.enabled=true",
        "profile.steps=[3,4]",
    ]
    out["ddp-first-half"] = ["recipe=ddp", *SMALL, "precision=bf16", "train.stop_at=4"]
    for model in PLANNED_MODELS:
        for recipe in PLANNED_RECIPES:
            out[f"plan-{model}-{recipe}"] = [f"recipe={recipe}", f"model={model}", *PLANNED]
    out["plan-gpt_350m-fsdp-offload"] = ["recipe=fsdp", "model=gpt_350m", *PLANNED, *OFFLOAD]
    return out


OFFLOAD = ["train.activation_offload=true", "train.measure_activations=true"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, int]]:
    """The cases started together as far as the GPUs' memory holds them (an out-of-memory
    run because the GPU is shared would say nothing about the recipe); then the second half
    of the split run (it resumes). {name: (run dir, exit code)}."""
    root = tmp_path_factory.mktemp("gpu")
    todo = chosen(cases(), os.environ.get("GPU_CASES", ""))
    budget = int(0.9 * min(torch.cuda.get_device_properties(i).total_memory for i in range(GPUS)))
    codes = schedule(todo, lambda name, over: _start(root / name, over), budget, time.time() + 900)
    if "ddp-first-half" in todo:
        todo["ddp-resumed"] = [o for o in todo["ddp-first-half"] if o != "train.stop_at=4"]  # resumes from step 4
        codes["ddp-resumed"] = ended(_start(root / "ddp-first-half", todo["ddp-resumed"], log=root / "ddp-resumed.log"))
    return {name: (root / ("ddp-first-half" if name == "ddp-resumed" else name), code) for name, code in codes.items()}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_every_recipe_trains_in_bf16_and_checkpoints(runs, recipe):
    if RECIPES[recipe] is None:
        pytest.skip(f"{recipe} splits the model over ranks: needs 2 GPUs (this machine has {GPUS})")
    run = finished(runs, f"{recipe}-bf16")
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["loss"]) for r in rows) and rows[-1]["loss"] < rows[0]["loss"]
    assert rows[-1]["mem/peak_bytes"] > 0 and rows[-1]["tokens_per_s"] > 0
    assert (run / "checkpoints" / f"step_{STEPS:08d}").is_dir() and (run / "checkpoints" / "step_00000004").is_dir()
    summary = json.loads((run / "summary.json").read_text())
    record(
        f"recipe-{recipe}",
        {
            "recipe": recipe,
            "loss": [r["loss"] for r in rows],
            "mfu": summary["mfu"],
            "peak_bytes": summary["peak_mem_bytes"],
            "tokens_per_s": summary["tokens_per_s"],
        },
    )


@pytest.mark.parametrize("recipe", FP16)
def test_fp16_scales_the_loss_and_counts_skipped_steps(runs, recipe):
    run = finished(runs, f"{recipe}-fp16")
    rows, summary = read_metrics(run), json.loads((run / "summary.json").read_text())
    assert all("loss_scale" in r and "skipped_steps" in r for r in rows)
    skipped = summary["skipped_steps"]
    assert isinstance(skipped, int) and 0 <= skipped < STEPS and skipped == rows[-1]["skipped_steps"]
    if skipped:  # each overflow halves the scale
        assert rows[-1]["loss_scale"] < rows[0]["loss_scale"] * 2**0.5 or rows[0]["skipped_steps"]
    assert all(math.isfinite(r["loss"]) for r in rows)
    record(f"fp16-{recipe}", {"skipped_steps": skipped, "loss_scale": [r["loss_scale"] for r in rows]})


def test_fp16_is_refused_where_no_scaler_exists(runs):
    run, code = ran(runs, "fsdp-fp16")
    log = (run.parent / "fsdp-fp16.log").read_text()
    assert code == 2 and "recipe fsdp supports bf16 and fp32 (it has no fp16 loss scaler)" in log, log[-2000:]
    assert not (run / "metrics.jsonl").exists()


@pytest.mark.parametrize("recipe", ["ddp", "fsdp"])
def test_compiled_training_matches_eager(runs, recipe):
    compiled, eager = read_metrics(finished(runs, f"{recipe}-compile")), read_metrics(finished(runs, f"{recipe}-bf16"))
    assert [r["step"] for r in compiled] == list(range(1, STEPS + 1))
    # The eager run checkpoints activations (recomputation gives the same numbers); both in bf16.
    for a, b in zip(compiled, eager):
        assert abs(a["loss"] - b["loss"]) <= 0.02 * abs(b["loss"]), (a["step"], a["loss"], b["loss"])


def test_a_resume_continues_the_run(runs):
    straight, resumed = finished(runs, "ddp-bf16"), finished(runs, "ddp-resumed")
    assert "resumed from" in (resumed.parent / "ddp-resumed.log").read_text()
    a, b = read_metrics(straight), read_metrics(resumed)
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    for x, y in zip(a[4:], b[4:]):  # after the resume; GPU kernels (atomics) are not bit-for-bit
        assert abs(x["loss"] - y["loss"]) <= 0.02 * abs(x["loss"]), (x["step"], x["loss"], y["loss"])


def test_the_memory_snapshot_is_written(runs):
    run = finished(runs, "ddp-profiled")
    snapshot = run / "profile" / "memory_snapshot_rank0.pickle"
    with open(snapshot, "rb") as f:  # our own file, written by torch.cuda.memory._dump_snapshot
        data = pickle.load(f)
    assert data["segments"] and data["device_traces"], "an empty snapshot"
    assert any(p.suffix == ".json" or p.name.endswith(".json.gz") for p in (run / "profile").rglob("*"))


def test_one_host_synchronisation_per_logged_step(runs):
    """Profiled steps 3 (not logged) and 4 (logged, logger.log_every=2): the device's copies
    to the host and the host's waits on the device, from the rank's trace. The loop reads
    its scalars in one copy on a logged step and none on the others."""
    trace = next((finished(runs, "ddp-profiled") / "profile").glob("rank0*.json"))
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    to_host = [e for e in events if e["name"].startswith("Memcpy DtoH")]
    waits = [e for e in events if e["name"] in ("cudaStreamSynchronize", "cudaDeviceSynchronize")]
    record(
        "host-syncs",
        {"steps": [3, 4], "logged": [4], "device_to_host_copies": len(to_host), "synchronize_calls": len(waits)},
    )
    assert len(to_host) <= 1, [e["name"] for e in to_host]


@pytest.mark.parametrize("model", PLANNED_MODELS)
@pytest.mark.parametrize("recipe", PLANNED_RECIPES)
def test_the_plan_holds_on_the_gpu(runs, model, recipe):
    """The planner's per-rank peak (the step's total or start-up, whichever is larger)
    against torch.cuda.max_memory_allocated of the run, within 10%."""
    from launcher.launch import cli
    from launcher.planner import plan as planner

    run = finished(runs, f"plan-{model}-{recipe}")
    cfg, _, _ = cli.compose_config([f"recipe={recipe}", f"model={model}", *PLANNED])
    row = planner.memory_row(
        cfg, planner.layout_for(cfg, GPUS), cfg.train.activation_checkpointing, cfg.train.micro_batch
    )
    measured = max(r["mem/peak_bytes"] for r in read_metrics(run))
    ratio = measured / row.peak
    record(
        f"plan-{model}-{recipe}",
        {
            "model": model,
            "recipe": recipe,
            "world": GPUS,
            "planned": row.peak,
            "measured": measured,
            "ratio": ratio,
            "parts": {
                "params": row.params,
                "grads": row.grads,
                "optim": row.optim,
                "activations": row.activations,
                "temp": row.temp,
                "grads_kept": row.grads_kept,
                "grads_peak": row.grads_peak,
                "startup": row.startup,
            },
        },
    )
    assert abs(ratio - 1) <= 0.10, (
        f"{model} {recipe}: {measured / 2**30:.2f} GiB measured, {row.peak / 2**30:.2f} planned"
    )


def test_activation_offload_moves_the_planned_bytes_and_lowers_the_peak(runs):
    """train.activation_offload on CUDA (pinned memory, side stream, prefetch): the bytes it
    moved equal the plan's host activations, the peak is the planned one, the loss is the
    run's without offload, and the cost in tokens/s is recorded for bench/gpu.md."""
    from launcher.launch import cli
    from launcher.planner import plan as planner

    plain, offloaded = (
        read_metrics(finished(runs, "plan-gpt_350m-fsdp")),
        read_metrics(finished(runs, "plan-gpt_350m-fsdp-offload")),
    )
    cfg, _, _ = cli.compose_config(["recipe=fsdp", "model=gpt_350m", *PLANNED, *OFFLOAD])
    row = planner.memory_row(
        cfg, planner.layout_for(cfg, GPUS), cfg.train.activation_checkpointing, cfg.train.micro_batch
    )
    moved = next(r["mem/offloaded_activation_bytes"] for r in offloaded if "mem/offloaded_activation_bytes" in r)
    peaks = [max(r["mem/peak_bytes"] for r in m) for m in (plain, offloaded)]
    speed = [sum(r["tokens_per_s"] for r in m[1:]) / len(m[1:]) for m in (plain, offloaded)]
    record(
        "activation-offload",
        {
            "moved": moved,
            "planned_host": row.host["activations"],
            "peak_plain": peaks[0],
            "peak_offload": peaks[1],
            "planned_peak_offload": row.peak,
            "tokens_per_s_plain": speed[0],
            "tokens_per_s_offload": speed[1],
        },
    )
    assert abs(moved / row.host["activations"] - 1) <= 0.02
    assert abs(peaks[1] / row.peak - 1) <= 0.10
    for a, b in zip(offloaded, plain):  # exact copies; GPU kernels with atomics are not bit-for-bit between runs
        assert abs(a["loss"] - b["loss"]) <= 1e-3 * abs(b["loss"]), (a["step"], a["loss"], b["loss"])

"""precision=fp8 through the launcher, emulated on CPU (precision.fp8_emulate=true): fsdp on
two gloo ranks trains with torchao's Float8Linear in every block and stays within a small
distance of the same run in bf16. The speed and the loss over hundreds of steps need a GPU
with float8 tensor cores (tests/gpu/test_gpu.py)."""

from __future__ import annotations

import pytest
from runs import launch, read_metrics

RUN = (
    "model=gpt_tiny",
    "recipe=fsdp",
    "cluster.nproc_per_node=2",
    "train.seq_len=64",
    "train.micro_batch=4",
    "train.steps=6",
    "optim.warmup_steps=1",
    "logger.log_every=1",
    "logger=none",
)


@pytest.mark.slow
def test_fsdp_trains_in_emulated_float8_close_to_bf16(tmp_path):
    launch(*RUN, "precision=bf16", run_dir=tmp_path / "bf16")
    proc = launch(*RUN, "precision=fp8", "precision.fp8_emulate=true", run_dir=tmp_path / "fp8")
    assert "float8" in proc.stdout
    bf16, fp8 = read_metrics(tmp_path / "bf16"), read_metrics(tmp_path / "fp8")
    assert [r["step"] for r in fp8] == list(range(1, 7))
    for a, b in zip(fp8, bf16):
        assert abs(a["loss"] / b["loss"] - 1) < 0.02, (a["step"], a["loss"], b["loss"])
    assert fp8[-1]["loss"] < fp8[0]["loss"]

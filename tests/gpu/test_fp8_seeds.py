"""fp8 against bf16 over two seeds each (issue 51, part c): fsdp, gpt_350m, compiled, 200
steps. The parity bound is bf16's own spread: at every logged step after warm-up, fp8's mean
loss over its seeds is within the two bf16 seeds' distance (plus 1% of the loss, so that two
bf16 curves crossing at a step do not make the bound zero) of bf16's mean. The four runs
share the GPU (their losses are what is checked; their speeds are recorded, not compared).
The runs come from scripts/gpu_cases.py. Skipped without float8 tensor cores."""

from __future__ import annotations

import statistics
import sys

import pytest
import torch
from gpu_runs import GPUS, finished, record, together
from runs import REPO, read_metrics

sys.path.insert(0, str(REPO / "scripts"))
from gpu_cases import FP8_SEEDS, fp8_runs  # noqa: E402

FP8_GPU = GPUS > 0 and torch.cuda.get_device_capability(0) >= (8, 9)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not FP8_GPU, reason="precision=fp8 needs float8 tensor cores (compute capability 8.9+)"),
]
TITLE = "fp8 against bf16 (fsdp, gpt_350m, compiled, seq 1024 x 8), loss by step, two seeds each"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return together(tmp_path_factory.mktemp("fp8"), fp8_runs())


def test_fp8_stays_within_bf16s_own_spread(runs):
    curves = {(p, s): read_metrics(finished(runs, f"fp8-{p}-seed{s}")) for p in ("bf16", "fp8") for s in FP8_SEEDS}
    steps = [r["step"] for r in curves[("bf16", FP8_SEEDS[0])]][2:]  # after warm-up (20 steps)
    loss = {key: {r["step"]: r["loss"] for r in rows} for key, rows in curves.items()}
    outside = []
    for step in steps:
        bf16 = [loss[("bf16", s)][step] for s in FP8_SEEDS]
        fp8 = [loss[("fp8", s)][step] for s in FP8_SEEDS]
        gap = abs(statistics.mean(fp8) - statistics.mean(bf16))
        bound = abs(bf16[0] - bf16[1]) + 0.01 * statistics.mean(bf16)
        record(
            f"fp8-step-{step:05d}",
            {
                "step": step,
                "bf16": bf16,
                "fp8": fp8,
                "gap": gap,
                "bound": bound,
                "table": {
                    "title": TITLE,
                    "columns": [
                        "step",
                        *(f"bf16 seed {s}" for s in FP8_SEEDS),
                        *(f"fp8 seed {s}" for s in FP8_SEEDS),
                        "|fp8 - bf16| (means)",
                        "bound",
                    ],
                    "row": [step, *(f"{x:.4f}" for x in bf16 + fp8), f"{gap:.4f}", f"{bound:.4f}"],
                },
            },
        )
        if gap > bound:
            outside.append((step, round(gap, 4), round(bound, 4)))
    speed = {f"{p}-seed{s}": statistics.mean(r["tokens_per_s"] for r in rows[2:]) for (p, s), rows in curves.items()}
    record("fp8-speed", {"tokens_per_s": speed, "note": "four runs shared the GPU"})
    assert not outside, f"fp8 outside bf16's own spread at (step, gap, bound): {outside}"

"""Every single-GPU cell against the plan (issue 51, part a): ddp, fsdp, zero1-3 and both
offloads at world size 1, bf16 and fp16 (the engines with a loss scaler), activation
checkpointing none and full, on gpt_350m at seq 1024 x 4: the run's
torch.cuda.max_memory_allocated within 10% of the planner's peak, and its start-up peak
(summary.json's startup.device_peak_bytes) not above the plan's start-up. The runs come from
scripts/gpu_cases.py (make gpu-check's cases a-bf16 and a-fp16, GPU_CASES=cell-bf16- ...)
and start together as far as the GPU's memory holds them. Skipped without a CUDA GPU."""

from __future__ import annotations

import json
import os
import sys

import pytest
from gpu_runs import GPUS, chosen, finished, gib, plan_row, record, together
from runs import REPO, read_metrics

sys.path.insert(0, str(REPO / "scripts"))
from gpu_cases import cell_runs  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="no CUDA GPU")]

CELLS = {
    **cell_runs("bf16", "none"),
    **cell_runs("bf16", "full"),
    **cell_runs("fp16", "none"),
    **cell_runs("fp16", "full"),
}
STARTUP_SLACK = 256 * 2**20  # what start-up allocates beyond the states the plan counts (buffers, the rotary table)
TITLE = "The plan against the GPU, per rank (gpt_350m, seq 1024 x micro-batch 4, world size 1)"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return together(tmp_path_factory.mktemp("cells"), chosen(CELLS, os.environ.get("GPU_CASES", "")))


@pytest.mark.parametrize("name", list(CELLS))
def test_the_plan_holds_for_every_single_gpu_cell(runs, name):
    run = finished(runs, name)
    row = plan_row(CELLS[name], world=1)
    measured = max(r["mem/peak_bytes"] for r in read_metrics(run))
    startup = json.loads((run / "summary.json").read_text())["startup"]["device_peak_bytes"][0]
    ratio = measured / row.peak
    _, precision, ac, recipe = name.split("-", 3)
    record(
        name,
        {
            "planned": row.peak,
            "measured": measured,
            "ratio": ratio,
            "planned_startup": row.startup,
            "measured_startup": startup,
            "table": {
                "title": TITLE,
                "columns": [
                    "recipe",
                    "precision",
                    "checkpointing",
                    "planned GiB",
                    "measured GiB",
                    "measured / planned",
                    "start-up planned GiB",
                    "start-up measured GiB",
                ],
                "row": [
                    recipe,
                    precision,
                    ac,
                    gib(row.peak),
                    gib(measured),
                    f"{ratio:.3f}",
                    gib(row.startup),
                    gib(startup),
                ],
            },
        },
    )
    assert abs(ratio - 1) <= 0.10, f"{name}: {measured / 2**30:.2f} GiB measured, {row.peak / 2**30:.2f} planned"
    assert startup is not None and startup <= max(1.10 * row.startup, row.startup + STARTUP_SLACK), (
        f"{name}: start-up {startup / 2**30:.2f} GiB measured, {row.startup / 2**30:.2f} planned"
    )

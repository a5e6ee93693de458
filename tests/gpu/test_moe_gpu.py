"""MoE on CUDA (issue 52's CUDA path, run by make gpu-check's case h-moe): the experts'
grouped matrix multiplication (`torch._grouped_mm` under bf16 autocast, experts.py) against
the loop over experts on the same weights, forward and every gradient; and an MoE run under
fsdp on one GPU whose torch.cuda.max_memory_allocated holds the planner's peak within 10%.
Expert parallelism over NCCL needs one GPU a rank; on one GPU it is not run. Skipped
without a CUDA GPU."""

from __future__ import annotations

import sys

import pytest
import torch
from gpu_runs import GPUS, finished, gib, plan_row, record, together
from runs import REPO, read_metrics

sys.path.insert(0, str(REPO / "scripts"))
from gpu_cases import MOE_RUNS  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="no CUDA GPU")]


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
def test_grouped_mm_equals_the_loop_over_experts():
    """16 experts of 1024 x 2816, 4096 rows routed unevenly (one expert gets none): the
    grouped path in bf16 against the loop in fp32 on the same weights, relative error of the
    output and of each gradient under 2% (bf16's rounding of a 1024-long dot product)."""
    from launcher.models.experts import expert_mlp

    g = torch.Generator(device="cuda").manual_seed(0)
    e, dim, hidden, n = 16, 1024, 2816, 4096
    counts = torch.randint(0, 2 * n // e, (e,), device="cuda", generator=g)
    counts[3] = 0
    rows = int(counts.sum())
    x = torch.randn(rows, dim, device="cuda", generator=g)
    w = [
        torch.randn(e, *shape, device="cuda", generator=g) * 0.02
        for shape in ((hidden, dim), (dim, hidden), (hidden, dim))
    ]
    dy = torch.randn(rows, dim, device="cuda", generator=g)

    def run(grouped: bool):
        leaves = [t.clone().requires_grad_() for t in (x, *w)]
        with torch.autocast("cuda", torch.bfloat16, enabled=grouped):
            out = expert_mlp(*leaves, counts)
        out.float().backward(dy)
        return [out.float(), *(t.grad.float() for t in leaves)]

    for name, a, b in zip(("out", "x", "w1", "w2", "w3"), run(True), run(False)):
        rel = ((a - b).norm() / b.norm()).item()
        record(f"moe-grouped-{name}", {"relative_error": rel})
        assert rel < 0.02, (name, rel)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return together(tmp_path_factory.mktemp("moe"), MOE_RUNS)


@pytest.mark.parametrize("name", list(MOE_RUNS))
def test_an_moe_run_holds_the_planned_memory(runs, name):
    run = finished(runs, name)
    rows = read_metrics(run)
    row = plan_row(MOE_RUNS[name], world=1)
    measured = max(r["mem/peak_bytes"] for r in rows)
    ratio = measured / row.peak
    record(
        name,
        {
            "planned": row.peak,
            "measured": measured,
            "ratio": ratio,
            "loss": [r["loss"] for r in rows],
            "table": {
                "title": "MoE on the GPU against the plan (one rank, bf16, grouped experts)",
                "columns": ["run", "planned GiB", "measured GiB", "measured / planned"],
                "row": [name, gib(row.peak), gib(measured), f"{ratio:.3f}"],
            },
        },
    )
    assert all(r["loss"] == r["loss"] for r in rows), "a loss is NaN"
    assert abs(ratio - 1) <= 0.10, f"{name}: {measured / 2**30:.2f} GiB measured, {row.peak / 2**30:.2f} planned"

"""Start-up: what a rank holds when its engine is ready, measured on real ranks against the
planner (launcher.planner.plan.start_up), and never the whole model where the recipe shards it.

One `torchrun --nproc-per-node 2` per recipe, `gpt_125m` (Ψ = 124M: 4Ψ = 494 MB, far
above what the processes' own allocations vary by), through the rank's own start-up
(launcher.rank.entry.start, as scripts/bench_startup.py drives it), stopping before step 1:
the figures are those summary.json's `startup` records (tests/e2e/test_train.py reads them
back from a real run). Per rank, the peak RSS when the engine was ready less the RSS
just before the model was built (the interpreter, torch, the recipe's imports, the
process group) is what building the model and the engine cost it. On a CPU the
planner's device and host bytes are both host memory, so their sum is what it predicts.
"""

from __future__ import annotations

import sys

import pytest
from runs import REPO

from launcher.launch import cli
from launcher.planner import plan as planner
from launcher.planner.memory import ParamCounts

sys.path.insert(0, str(REPO / "scripts"))
from bench_startup import run_case  # noqa: E402

pytestmark = pytest.mark.slow

COMMON = ["model=gpt_125m", "train.micro_batch=2", "cluster.nproc_per_node=2"]
# name: overrides (precision bf16 unless said: DeepSpeed keeps bf16 weights; the others fp32 weights either way).
# tp's formula is pp's (4 x the rank's share: launcher.planner.plan.param_share, checked in test_plan.py).
RUNS = {
    "ddp": ["recipe=ddp"],
    "fsdp": ["recipe=fsdp", "precision=fp32"],
    "pp": ["recipe=pp", "parallel.pp_microbatches=2"],
    "zero2": ["recipe=zero2"],
    "zero3": ["recipe=zero3"],
    "zero3_offload": ["recipe=zero3_offload"],
}
TOLERANCE = 0.15  # the bound


@pytest.fixture(scope="module")
def startup():
    done: dict[str, list[dict]] = {}

    def get(name: str) -> list[dict]:
        if name not in done:
            done[name] = run_case(REPO, [*COMMON, *RUNS[name]])
        return done[name]

    return get


def built(ranks: list[dict]) -> int:
    """What building the model and the engine cost the worse rank."""
    return max(r["host_peak_bytes"] - r["host_base_bytes"] for r in ranks)


@pytest.mark.parametrize("name", list(RUNS))
def test_start_up_matches_the_plan(startup, name):
    ranks = startup(name)
    cfg, _, _ = cli.compose_config([*COMMON, *RUNS[name]])
    got = built(ranks)
    device, host = planner.start_up(cfg, planner.layout_for(cfg, 2))
    want = device + host  # on a CPU both are host memory
    psi = ParamCounts.of(cfg.model).total
    print(
        f"{name}: built {got / psi:.2f} bytes/param, planned {want / psi:.2f} "
        f"(device {device / psi:.2f} + host {host / psi:.2f}); ready after {max(r['seconds'] for r in ranks):.1f} s"
    )
    assert abs(got - want) <= TOLERANCE * want, (name, got, want)
    assert all(r["device_peak_bytes"] is None and 0 < r["seconds"] < 600 for r in ranks)


def test_fsdp_never_holds_the_whole_model(startup):
    """Built on the meta device, sharded, then each rank allocates its half: the start-up
    cost is half the fp32 weights (Adam's moments come with the first step); ddp, which
    replicates by design, holds the whole model and its gradient buckets."""
    whole = 4 * ParamCounts.of(cli.compose_config(COMMON)[0].model).total
    assert built(startup("fsdp")) < 0.55 * whole, built(startup("fsdp")) / whole
    assert built(startup("ddp")) > 1.9 * whole, built(startup("ddp")) / whole


def test_the_launcher_of_a_real_run_never_imports_torch(tmp_path):
    """A whole launch (compose, validate, the run directory, torchrun supervised to the
    end, the summary printed) in a process that ends without having imported torch: the
    ranks import it, the launcher only decides and watches (about 1.5 s less per launch)."""
    import json
    import subprocess

    run = tmp_path / "run"
    argv = [
        "train",
        "model=gpt_tiny",
        "train.steps=1",
        "optim.warmup_steps=1",
        "logger=none",
        "checkpoint.save_final=false",
        f"hydra.run.dir={run}",
    ]  # the default ranks: 2 CPU processes, or one per GPU
    code = (
        "import sys\nfrom launcher.launch.cli import main\n"
        f"rc = main({argv!r})\nprint('torch imported:', 'torch' in sys.modules)\nsys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "torch imported: False", proc.stdout[-2000:]
    assert json.loads((run / "summary.json").read_text())["steps"] == 1

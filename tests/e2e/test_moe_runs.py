"""Expert parallel end to end (parallel.ep, launcher/parallel/experts.py): moe_tiny on real
gloo ranks, fp32, a few steps. ep=2 must train as ep=1 and as one process: the same loss
and gradient norm at every step (the experts of a token are the same whoever holds them;
only reduction order differs), the same initial weights, the same dropped tokens under a
capacity factor, and a save + resume under ep continues as an uninterrupted run. Runs are
launched once, on first use, and shared by the tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from runs import here, read_metrics
from shared import Run, SharedRuns

from launcher import config as C
from launcher.models.gpt import GPT

pytestmark = pytest.mark.slow

REL = 1e-4  # fp32, reduction order only (measured: below 1e-6 on the loss over 6 steps)
STEPS, HALF = 6, 3
COMMON = [
    "model=moe_tiny",
    f"train.steps={STEPS}",
    "optim.warmup_steps=2",
    "train.seq_len=64",
    "train.micro_batch=2",
    "train.global_batch=8",
    "logger=none",
    "logger.log_every=1",
    "debug.startup_digest=true",
    "precision=fp32",
    "cluster.cpu_threads=1",
]  # one thread a rank: one process with two spins on a busy machine
STEP_HALF = f"checkpoints/step_{HALF:08d}"
CAP = ["model.moe.capacity_factor=1.0", f"train.stop_at={HALF}", "checkpoint.save_final=false"]

# Each run by name (tests/helpers/shared.py): its overrides, the run whose step-HALF checkpoint it resumes,
# a relaunch of its own directory
RUNS = {
    "one": Run(["recipe=ddp", "cluster.nproc_per_node=1"]),
    "fsdp": Run(["recipe=fsdp"]),
    # stopped at HALF with a checkpoint, then the run directory relaunched: it resumes itself
    "fsdp_ep2": Run(
        ["recipe=fsdp", "parallel.ep=2", f"checkpoint.every={HALF}", f"train.stop_at={HALF}"],
        then=[["recipe=fsdp", "parallel.ep=2"]],
    ),
    "ddp_ep2": Run(["recipe=ddp", "parallel.ep=2", f"checkpoint.every={HALF}"]),
    "ddp_ep2_resumed": Run(["recipe=ddp", "parallel.ep=2"], resume_from="ddp_ep2"),
    # ddp's expert files at another ep: joined and cut again (ddp), read whole into DTensor shards (fsdp)
    "one_from_ddp_ep2": Run(["recipe=ddp", "cluster.nproc_per_node=1"], resume_from="ddp_ep2"),
    "fsdp_ep2_from_ddp_ep2": Run(["recipe=fsdp", "parallel.ep=2"], resume_from="ddp_ep2"),
    # experts over 2 ep ranks and FSDP-sharded over the other 2 (efsdp): 2-D expert shards
    "fsdp4_ep2": Run(["recipe=fsdp", "parallel.ep=2", "cluster.nproc_per_node=4"]),
    # 2 experts on 4 ranks: more ranks than experts, so FSDP cuts them on dimension 1 (at ep=1 over 4
    # ranks, at ep=2 one expert over 2), against one process with the same 2 experts
    "one_e2": Run(["recipe=ddp", "cluster.nproc_per_node=1", "model.moe.experts=2"]),
    "fsdp4_e2": Run(["recipe=fsdp", "cluster.nproc_per_node=4", "model.moe.experts=2"]),
    "fsdp4_e2_ep2": Run(["recipe=fsdp", "cluster.nproc_per_node=4", "model.moe.experts=2", "parallel.ep=2"]),
    # a capacity: tokens dropped where they are, before dispatch
    "fsdp_cap": Run(["recipe=fsdp", *CAP]),
    "ddp_ep2_cap": Run(["recipe=ddp", "parallel.ep=2", *CAP]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> SharedRuns:
    """name -> its run directory, launched (and relaunched) on first use."""
    return SharedRuns(tmp_path_factory.mktemp("moe"), RUNS, common=COMMON, checkpoint=STEP_HALF)


def rows(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run)}


def worst(run: Path, ref: Path, steps, key: str) -> float:
    got, want = rows(run), rows(ref)
    assert sorted(got) == list(steps), sorted(got)
    return max(abs(got[s][key] - want[s][key]) / abs(want[s][key]) for s in steps)


@pytest.mark.parametrize("name", ["fsdp", "fsdp_ep2", "ddp_ep2", "fsdp4_ep2"])
def test_expert_parallel_trains_as_one_process(runs, name):
    """Loss and gradient norm of every step equal one process's (fsdp_ep2 was stopped at
    HALF and resumed from its own checkpoint: uninterrupted on the loss too)."""
    run, ref = runs(name), runs("one")
    loss, norm = worst(run, ref, range(1, STEPS + 1), "loss"), worst(run, ref, range(1, STEPS + 1), "grad_norm")
    print(f"{name}: max relative difference to one process: loss {loss:.1e}, grad norm {norm:.1e}")
    assert loss < REL and norm < REL, (loss, norm)
    assert all(r["moe/dropped"] == 0 for r in read_metrics(run))  # no capacity: nothing dropped
    assert rows(run)[STEPS]["loss"] < rows(run)[1]["loss"]


@pytest.mark.parametrize("name", ["fsdp4_e2", "fsdp4_e2_ep2"])
def test_experts_cut_on_dimension_1_train_as_one_process(runs, name):
    """Fewer experts than the ranks FSDP shards them over: each rank holds a slice of every
    expert's rows (launcher/parallel/experts.py::expert_placement), drawn at its place in the
    whole tensor (the same initial weights) and trained as one process: the same loss and
    gradient norm at every step."""
    run, ref = runs(name), runs("one_e2")
    loss, norm = worst(run, ref, range(1, STEPS + 1), "loss"), worst(run, ref, range(1, STEPS + 1), "grad_norm")
    print(f"{name}: max relative difference to one process: loss {loss:.1e}, grad norm {norm:.1e}")
    assert loss < REL and norm < REL, (loss, norm)
    digests = {json.loads((r / "summary.json").read_text())["startup"]["weights_digest"][0] for r in (run, ref)}
    assert len(digests) == 1


def test_initial_weights_do_not_depend_on_ep(runs):
    """The experts' shards are drawn at their global place (a DTensor's offset under fsdp,
    the box ddp's plain shards record): ep=2 starts from ep=1's weights, bytewise."""
    digests = {
        name: json.loads((runs(name) / "summary.json").read_text())["startup"]["weights_digest"]
        for name in ("one", "fsdp", "ddp_ep2", "fsdp4_ep2")
    }
    assert len({d for ds in digests.values() for d in ds}) == 1, digests


def test_resume_under_ep_continues_the_run(runs):
    """fsdp (DCP, 2-D expert shards) and ddp (one file of experts per ep rank) save under
    ep=2 and resume where they were: steps HALF+1.. as the uninterrupted runs; ddp's files
    resume at ep=1 on one process and under fsdp too."""
    fsdp = runs("fsdp_ep2")
    assert f"resumed from {fsdp / STEP_HALF} at step {HALF}" in (fsdp / "stdout2.txt").read_text()
    resumed, source = runs("ddp_ep2_resumed"), runs("ddp_ep2")
    assert f"resumed from {source / STEP_HALF} at step {HALF}" in (resumed / "stdout1.txt").read_text()
    engine = source / STEP_HALF / "engine"
    assert sorted(p.name for p in engine.glob("experts-*")) == [
        "experts-00000-of-00002.pt",
        "experts-00001-of-00002.pt",
    ]
    assert worst(resumed, source, range(HALF + 1, STEPS + 1), "loss") < 1e-6  # the same layout: the same sums
    for name in ("one_from_ddp_ep2", "fsdp_ep2_from_ddp_ep2"):  # at another ep, another engine
        assert worst(runs(name), runs("one"), range(HALF + 1, STEPS + 1), "loss") < REL, name


def test_export_of_a_ddp_ep_checkpoint_is_the_whole_model(runs):
    """`make export` joins ddp's expert files: the model fsdp trained at ep=1, up to reduction order."""
    from launcher.launch.commands.export import load_exported

    run = runs("ddp_ep2")
    path = run / "export" / f"step_{STEPS:08d}" / "model.safetensors"
    assert str(path) in here("export", str(run)).stdout
    exported = load_exported(path)
    assert exported.layers[0].feed_forward.experts.w1.shape[0] == 8  # all of moe_tiny's experts
    final = run / f"checkpoints/step_{STEPS:08d}/engine"
    one = GPT(C.load_frozen(runs("one")).model)
    one.load_state_dict(torch.load(runs("one") / f"checkpoints/step_{STEPS:08d}/engine/model.pt", weights_only=True))
    x = torch.randint(0, 256, (2, 64))
    with torch.no_grad():
        assert torch.allclose(exported(x), one(x), rtol=1e-4, atol=1e-4)
    assert final.is_dir()


def test_capacity_drops_the_same_tokens_under_ep(runs):
    """capacity_factor=1.0 drops rows on the rank that routed them, before dispatch: the
    count per step and the losses are ep=1's."""
    one, two = rows(runs("fsdp_cap")), rows(runs("ddp_ep2_cap"))
    assert sorted(one) == sorted(two) == list(range(1, HALF + 1))
    assert all(one[s]["moe/dropped"] > 0 for s in one), one
    assert [one[s]["moe/dropped"] for s in one] == [two[s]["moe/dropped"] for s in two]
    assert max(abs(one[s]["loss"] - two[s]["loss"]) / one[s]["loss"] for s in one) < REL
    print("dropped per step:", [one[s]["moe/dropped"] for s in one])

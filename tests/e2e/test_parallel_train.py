"""fsdp, tp, pp, tp_fsdp end to end: real torchrun, 2 and 4 gloo processes, fp32.

Every run below trains the same STEPS (12) steps (same seed, data and global batch) and
is compared with ddp: the loss of every step within REL. The runs that resume start from
another run's step-6 checkpoint (HALF: DCP, or ddp's files) at another layout (resharding)
and must continue with ddp's losses for steps 7-12. The same runs give the memory per rank and the
exports and the held-out loss (train.eval_every, at HALF and STEPS). Runs are launched
once, on first use, and shared by the tests.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from runs import evaluated, here, read_metrics
from shared import Run, SharedRuns

from launcher import config as C
from launcher.config import block_matmul_params, num_params
from launcher.launch import cli
from launcher.models.gpt import GPT

pytestmark = pytest.mark.slow

# Reduction order is all that differs (measured: 1e-7 relative over 20 steps, fp32).
REL = 1e-4
STEPS, HALF = 12, 6  # every run's steps; the checkpoint (and stop) half-way, where the resumed runs start
COMMON = [
    f"train.steps={STEPS}",
    "optim.warmup_steps=4",
    "train.seq_len=64",
    "train.micro_batch=2",
    "train.global_batch=8",
    "logger=none",
    "logger.log_every=1",
    f"checkpoint.every={HALF}",
    "debug.startup_digest=true",
    f"train.eval_every={HALF}",
    "train.eval_samples=16",
]
STEP_HALF = f"checkpoints/step_{HALF:08d}"
ASYNC = "checkpoint.async_save=true"

# Each run by name (tests/helpers/shared.py): its overrides (fp32 unless they say a precision), the run whose
# step-HALF checkpoint it resumes, a second launch of its own directory (which resumes it by itself)
RUNS = {
    "ddp": Run(["recipe=ddp"]),
    # 2 ranks to step HALF, then the same run directory relaunched on 4 (the command);
    # the loss in 4 slices of the sequence (train.loss_chunks), the head in FSDP's root unit
    "fsdp": Run(
        ["recipe=fsdp", "train.activation_checkpointing=full", f"train.stop_at={HALF}", "train.loss_chunks=4"],
        then=[["recipe=fsdp", "cluster.nproc_per_node=4", "train.loss_chunks=4", "precision=fp32"]],
    ),
    # tp, pp and tp_fsdp save asynchronously (DCP's async_save): the runs resumed from them
    # prove those checkpoints whole
    # (tp and tp_fsdp4 recompute at op level: blocks keep their matmuls' outputs, DTensors)
    "tp": Run(["recipe=tp", "parallel.tp=2", "train.activation_checkpointing=op", ASYNC]),
    "pp": Run(["recipe=pp", "parallel.pp_schedule=1f1b", "train.activation_checkpointing=selective", ASYNC]),
    "tp_fsdp4": Run(
        [
            "recipe=tp_fsdp",
            "cluster.nproc_per_node=4",
            "parallel.sequence_parallel=true",
            "train.activation_checkpointing=op",
            ASYNC,
        ],
    ),
    # resharding: another layout picks up a step-HALF checkpoint
    # pp x fsdp: two stages, each sharded over two ranks, two virtual stages per rank
    "pp_fsdp_interleaved4_from_ddp": Run(
        ["recipe=pp_fsdp", "cluster.nproc_per_node=4", "parallel.pp_schedule=interleaved_1f1b"],
        resume_from="ddp",
    ),
    "fsdp_from_tp": Run(["recipe=fsdp"], resume_from="tp"),
    "one_from_pp": Run(["recipe=ddp", "cluster.nproc_per_node=1"], resume_from="pp"),
    # pp x tp with sequence parallel: each stage split over two ranks, uneven stages
    "pp_tp_gpipe4_from_tp_fsdp4": Run(
        [
            "recipe=pp",
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
            "cluster.nproc_per_node=4",
            "parallel.pp_schedule=gpipe",
            "parallel.pp_split=[1]",
        ],
        resume_from="tp_fsdp4",
    ),
    # untied embeddings: vocabulary-parallel embedding, column-parallel head, HSDP
    "ddp_untied": Run(["recipe=ddp", "model.tie_embeddings=false"]),
    "tp4_untied": Run(
        ["recipe=tp", "model.tie_embeddings=false", "cluster.nproc_per_node=4", "parallel.sequence_parallel=true"],
    ),
    "hsdp4_from_tp4_untied": Run(
        ["recipe=fsdp", "model.tie_embeddings=false", "cluster.nproc_per_node=4", "parallel.dp_replicate=2"],
        resume_from="tp4_untied",
    ),
    # pp x tp x fsdp (dp_shard 1 on 4 processes): FSDP over tensor-parallel DTensors in each
    # stage, two stage roots per rank, a vocabulary-parallel embedding and column head
    "pp_tp_fsdp4_untied_from_tp4_untied": Run(
        [
            "recipe=pp_fsdp",
            "parallel.tp=2",
            "model.tie_embeddings=false",
            "cluster.nproc_per_node=4",
            "parallel.pp_schedule=interleaved_1f1b",
        ],
        resume_from="tp4_untied",
    ),
    # one process: the weights at step 0 must be those of every layout above
    "fsdp1": Run(["recipe=fsdp", "cluster.nproc_per_node=1", "train.stop_at=1", "checkpoint.every=0"]),
    # bf16: FSDP's mixed-precision policy; the first 8 of the STEPS
    "fsdp_bf16": Run(
        [
            "recipe=fsdp",
            "precision=bf16",
            "train.stop_at=8",
            "recipe.fsdp.cpu_offload=true",
            "recipe.fsdp.reshard_after_forward=false",
        ],
    ),
}
FRESH = ["fsdp", "tp", "pp", "tp_fsdp4"]
RESUMED = ["fsdp_from_tp", "one_from_pp", "pp_tp_gpipe4_from_tp_fsdp4", "pp_fsdp_interleaved4_from_ddp"]


def in_fp32(run: Run) -> Run:
    said = any(o.startswith("precision=") for o in run.overrides)
    return run if said else dataclasses.replace(run, overrides=[*run.overrides, "precision=fp32"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> SharedRuns:
    defined = {name: in_fp32(run) for name, run in RUNS.items()}
    return SharedRuns(tmp_path_factory.mktemp("parallel"), defined, common=COMMON, checkpoint=STEP_HALF)


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run)}


def assert_same_losses(run: Path, ref: Path, steps: range) -> float:
    got, want = losses(run), losses(ref)
    assert sorted(got) == list(steps), sorted(got)
    worst = max(abs(got[s] - want[s]) / want[s] for s in steps)
    assert worst < REL, f"{run.name}: loss differs from {ref.name} by {worst:.2e} relative"
    return worst


@pytest.mark.parametrize("name", FRESH)
def test_losses_match_ddp_over_every_step(runs, name):
    worst = assert_same_losses(runs(name), runs("ddp"), range(1, STEPS + 1))
    print(f"{name}: max relative loss difference to ddp {worst:.1e}")
    rows = read_metrics(runs(name))
    assert rows[-1]["loss"] < 0.9 * rows[0]["loss"]  # and it learns (measured: 0.855 after 12 steps)


@pytest.mark.parametrize("name", ["tp", "pp", "tp_fsdp4"])
def test_async_saves_of_the_dcp_layouts_were_written_in_the_background(runs, name):
    out = (runs(name) / "stdout1.txt").read_text()
    assert "checkpoint.async_save: " in out, out[-2000:]  # the host buffers, made after the first step
    for step in (HALF, STEPS):
        assert f"step_{step:08d} written in the background" in out, out[-2000:]


@pytest.mark.parametrize("name", RESUMED)
def test_resume_at_another_layout_continues_the_loss(runs, name):
    run, source = runs(name), runs(RUNS[name].resume_from)
    out = (run / "stdout1.txt").read_text()
    assert f"resumed from {source / STEP_HALF} at step {HALF}" in out
    worst = assert_same_losses(run, runs("ddp"), range(HALF + 1, STEPS + 1))
    print(f"{name}: max relative loss difference to ddp {worst:.1e}")
    assert losses(run)[HALF + 1] == pytest.approx(losses(source)[HALF + 1], rel=REL)


def test_every_layout_evaluates_ddps_held_out_loss(runs):
    """train.eval_every: each engine's forward-only pass (Engine.eval_step) evaluates the
    whole model on the same held-out samples, whatever holds its parts (shards, stages,
    tensor-parallel slices; a pipeline evaluates a step's batch at a time): ddp's val/loss
    within REL. fsdp was stopped right after its evaluation at HALF and relaunched on 4
    ranks, which evaluates each step once; the resumed layouts evaluate at STEPS.
    Held-out windows of a token file: tests/unit/test_held_out.py; ZeRO: test_zero.py."""
    reference = evaluated(runs("ddp"))
    assert sorted(reference) == [HALF, STEPS] and reference[STEPS] < reference[HALF]
    summary = json.loads((runs("ddp") / "summary.json").read_text())
    assert (summary["val_loss"], summary["val_step"]) == (reference[STEPS], STEPS)
    for name in [*FRESH, *RESUMED]:
        got = evaluated(runs(name))
        assert sorted(got) == ([STEPS] if name in RESUMED else [HALF, STEPS]), (name, got)
        for step, value in got.items():
            assert value == pytest.approx(reference[step], rel=REL), (name, step, value, reference[step])


def test_initial_weights_do_not_depend_on_the_layout(runs):
    """train.seed alone decides the weights at step 0: every rank of every layout fills its
    own part (a shard, a stage, a tensor-parallel slice) with the values the whole model
    has there (launcher/models/init.py), so the consolidated weights are the same bytes at
    1, 2 and 4 ranks under ddp, fsdp, tp, pp, tp_fsdp, pp x fsdp and pp x tp."""

    def digests(name):
        startup = json.loads((runs(name) / "summary.json").read_text())["startup"]
        assert startup["host_peak_bytes"] and all(s > 0 for s in startup["seconds"]), startup
        assert startup["device_peak_bytes"] == [None] * len(startup["seconds"])  # CPU
        return startup["weights_digest"]

    tied = {
        name: digests(name)
        for name in (
            "ddp",
            "fsdp1",
            "fsdp_from_tp",
            "fsdp",
            "tp",
            "pp",
            "tp_fsdp4",
            "pp_fsdp_interleaved4_from_ddp",
            "pp_tp_gpipe4_from_tp_fsdp4",
            "one_from_pp",
        )
    }
    assert {len(d) for d in tied.values()} == {1, 2, 4}  # world sizes 1 (fsdp1, one_from_pp), 2 and 4
    assert len({x for d in tied.values() for x in d}) == 1, tied
    untied = {
        name: digests(name)
        for name in ("ddp_untied", "tp4_untied", "hsdp4_from_tp4_untied", "pp_tp_fsdp4_untied_from_tp4_untied")
    }
    assert len({x for d in untied.values() for x in d}) == 1, untied
    assert untied["ddp_untied"] != tied["ddp"]


def test_relaunch_of_the_run_directory_on_more_ranks_continues(runs):
    """`make train RECIPE=fsdp ARGS="cluster.nproc_per_node=4"` on a run 2 ranks wrote."""
    run = runs("fsdp")
    out = (run / "stdout2.txt").read_text()
    assert f"resumed from {run / STEP_HALF} at step {HALF}" in out and "4 rank(s)" in out
    assert "mesh: pp 1 x dp_replicate 1 x dp_shard 4 x cp 1 x tp 1" in out
    assert [r["step"] for r in read_metrics(run)] == list(range(1, STEPS + 1))  # 1-HALF on 2 ranks, the rest on 4


def test_untied_tensor_parallel_and_hsdp_match_ddp(runs):
    ref = runs("ddp_untied")
    assert_same_losses(runs("tp4_untied"), ref, range(1, STEPS + 1))
    assert_same_losses(runs("hsdp4_from_tp4_untied"), ref, range(HALF + 1, STEPS + 1))
    assert (
        "mesh: pp 1 x dp_replicate 2 x dp_shard 2 x cp 1 x tp 1"
        in (runs("hsdp4_from_tp4_untied") / "stdout1.txt").read_text()
    )
    three = runs("pp_tp_fsdp4_untied_from_tp4_untied")
    assert_same_losses(three, ref, range(HALF + 1, STEPS + 1))
    assert "mesh: pp 2 x dp_replicate 1 x dp_shard 1 x cp 1 x tp 2" in (three / "stdout1.txt").read_text()


def _model(*overrides):
    cfg, _, _ = cli.compose_config(list(overrides))
    return cfg.model


def test_model_state_bytes_per_rank_match_the_formulas(runs):
    """Rank 0's mem/* (counted from its real local tensors) against the arithmetic."""
    m = _model()
    psi = num_params(m)
    n_tensors = 1 + 9 * m.n_layers + 1  # embedding (= head), 9 per block, final norm
    matmul = m.n_layers * block_matmul_params(m)  # split by tensor parallel
    replicated = psi - matmul  # embedding and norms: whole on every tensor-parallel rank
    block = block_matmul_params(m) + 2 * m.dim
    step_counters = 4 * n_tensors  # Adam's step, one fp32 scalar per parameter tensor

    def last(name):
        return read_metrics(runs(name))[-1]

    expected = {
        "ddp": 16 * psi + step_counters,
        "fsdp": 16 * psi // 4 + step_counters,  # 16Ψ/N: the steps after HALF ran on 4 ranks
        "tp": 16 * (matmul // 2 + replicated) + step_counters,
        "tp_fsdp4": 16 * (matmul // 4 + replicated // 2) + step_counters,
        # rank 0 is the first stage: the embedding and layers 0, 1 (balanced: 2 + 2)
        "pp": 16 * (m.vocab_size * m.dim + 2 * block) + 4 * (1 + 2 * 9),
        "one_from_pp": 16 * psi + step_counters,
    }
    on_two = read_metrics(runs("fsdp"))[HALF - 1]  # step HALF, still on 2 ranks
    assert on_two["mem/model_state_bytes"] == 16 * psi // 2 + step_counters
    for name, want in expected.items():
        row = last(name)
        assert row["mem/model_state_bytes"] == want, (name, row["mem/model_state_bytes"], want)
        assert row["mem/params_bytes"] == row["mem/grads_bytes"], name  # fp32 shards of both
        print(
            f"{name}: {row['mem/model_state_bytes']:,} bytes/rank = {row['mem/model_state_bytes'] / (16 * psi):.3f} x 16Ψ"
        )


def test_export_from_dcp_checkpoints_gives_the_same_model(runs, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from launcher.launch.commands.export import load_exported

    final = f"checkpoints/step_{STEPS:08d}"
    ddp_final = torch.load(runs("ddp") / final / "engine/model.pt", weights_only=True)
    reference = GPT(C.load_frozen(runs("ddp")).model)
    reference.load_state_dict(ddp_final)
    x = torch.randint(0, 256, (2, 64))
    for name in ("pp", "tp_fsdp4", "pp_fsdp_interleaved4_from_ddp"):  # stage-wise files; 2-D (strided) shards
        run = runs(name)
        path = run / "export" / f"step_{STEPS:08d}" / "model.safetensors"
        assert str(path) in here("export", str(run)).stdout
        exported = load_exported(path)
        # The same tensors as torch's own DCP converter reads (independent of our reader).
        dcp_to_torch_save(run / final / "engine", tmp_path / f"{name}.pt")
        direct = torch.load(tmp_path / f"{name}.pt", weights_only=True)["model"]
        state = exported.state_dict()
        assert set(direct) | {"output.weight"} == set(state)
        for k, v in direct.items():
            assert torch.equal(state[k], v), (name, k)
        assert torch.equal(state["output.weight"], state["tok_embeddings.weight"])  # tied
        with torch.no_grad():  # and the model ddp trained, up to reduction order
            assert torch.allclose(exported(x), reference(x), rtol=1e-4, atol=1e-4), name


def test_bf16_uses_fsdp_mixed_precision(runs):
    """bf16 parameters in compute (the loss moves off fp32's, a little), fp32 reduction;
    CPU offload and no resharding after forward run too."""
    bf16, fp32 = read_metrics(runs("fsdp_bf16")), losses(runs("fsdp"))
    assert [r["step"] for r in bf16] == list(range(1, 9))
    diffs = [abs(r["loss"] - fp32[r["step"]]) / fp32[r["step"]] for r in bf16]
    assert 1e-6 < max(diffs) < 2e-2, diffs
    assert bf16[-1]["loss"] < 0.95 * bf16[0]["loss"]  # it learns (about 0.90 after 8 steps, as fp32 does)
    summary = json.loads((runs("fsdp_bf16") / "summary.json").read_text())
    assert summary["model_state_bytes"] == 16 * num_params(_model()) // 2 + 4 * 38

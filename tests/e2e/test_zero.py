"""ZeRO recipes end to end: real launches (torchrun and DeepSpeed's launcher), 2 and 4 gloo
processes, the tiny and small models.

- fp32: zero1/2/3 give ddp's losses over 20 steps (ZeRO does the same mathematics).
- a checkpoint resumes at other world sizes (2 -> 1 -> 4 -> 2 ranks) on the same curve.
- export: consolidated weights from the shards give the trained model's logits.
- bf16 with offload, started by the `deepspeed` launcher, stopped by SIGTERM, resumed.
- model-state bytes per rank against the ZeRO paper, at 2 and 4 ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from runs import REPO, evaluated, here, launch, processes_of, read_metrics, start, wait_for_step
from shared import Run, SharedRuns

from launcher import config as C
from launcher.host import deepspeed_env
from launcher.manifest import verify
from launcher.planner.zero import zero_paper_bytes as paper_bytes
from launcher.planner.zero import zero_states
from launcher.rank.preempt import EXIT_PREEMPTED

deepspeed_env()  # DeepSpeed reads its accelerator when imported (engines/zero/__init__.py::import_deepspeed does this for a run)
from engines.zero.engine import model_state_bytes  # noqa: E402

pytestmark = pytest.mark.slow

# 20 steps, global batch 16 = micro-batch 4 x 2 accumulation x 2 ranks; the same global
# batch at 1 and 4 ranks (accumulation 4 and 1), so runs at any world size see the same data.
FP32 = [
    "precision=fp32",
    "train.steps=20",
    "optim.warmup_steps=5",
    "logger=none",
    "logger.log_every=1",
    "train.micro_batch=4",
    "train.global_batch=16",
    "debug.startup_digest=true",
]
FP32_REL = 1e-5  # the issue asked for 1e-4; measured: about 1e-7 (summation order only)
BF16_REL = 1e-3  # bf16 weights (ZeRO) against bf16 autocast with fp32 weights (ddp); measured: < 5e-4


PSI_TINY = 885_888  # gpt_tiny's parameters
EVAL = ["train.eval_every=10", "train.eval_samples=16"]  # fp32_runs: the held-out loss at steps 10 and 20


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


FP32_RUNS = {
    "ddp": Run(["recipe=ddp", "checkpoint.every=0"]),
    "zero1": Run(["recipe=zero1", "checkpoint.every=0"]),
    "zero2": Run(["recipe=zero2", "checkpoint.every=5", "checkpoint.keep=4"]),
    "zero3": Run(["recipe=zero3", "checkpoint.every=0", "train.loss_chunks=4", "train.activation_checkpointing=op"]),
}
"""ddp, zero1, zero2, zero3 in fp32 on 2 ranks (tests/helpers/shared.py); zero2 keeps a checkpoint every 5
steps; zero3 computes its loss in 4 slices of the sequence (train.loss_chunks: the head is called as a module,
so ZeRO-3 gathers its weight, and its gradient comes back through autograd) and recomputes its blocks at op
level (train.activation_checkpointing=op), still ddp's losses. Each evaluates its held-out loss (EVAL)."""


@pytest.fixture(scope="module")
def fp32_runs(tmp_path_factory) -> SharedRuns:
    return SharedRuns(tmp_path_factory.mktemp("fp32"), FP32_RUNS, common=[*FP32, *EVAL])


def startup(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())["startup"]


def test_zero_stages_start_from_ddps_weights(fp32_runs):
    """zero3's model is built inside deepspeed.zero.Init (each rank fills only its
    partitions), zero1/2's directly on the device: the consolidated weights at step 0 are
    ddp's, bit for bit (launcher/models/init.py)."""
    want = startup(fp32_runs["ddp"])["weights_digest"]
    assert len(set(want)) == 1
    for recipe in ("zero1", "zero2", "zero3"):
        assert startup(fp32_runs[recipe])["weights_digest"] == want, recipe


def test_zero_stages_give_ddp_losses_in_fp32(fp32_runs):
    ddp = read_metrics(fp32_runs["ddp"])
    assert [r["step"] for r in ddp] == list(range(1, 21))
    for recipe, stage in (("zero1", 1), ("zero2", 2), ("zero3", 3)):
        run = fp32_runs[recipe]
        rows = read_metrics(run)
        assert [r["step"] for r in rows] == list(range(1, 21)), recipe
        worst = max(rel(z["loss"], d["loss"]) for z, d in zip(rows, ddp))
        assert worst < FP32_REL, f"{recipe}: loss differs from ddp by {worst:.2e} (relative)"
        assert [z["lr"] for z in rows] == [d["lr"] for d in ddp], "not ddp's learning-rate schedule"
        assert max(rel(z["grad_norm"], d["grad_norm"]) for z, d in zip(rows, ddp)) < FP32_REL
        assert rows[-1]["loss"] < 0.8 * rows[0]["loss"]
        # The one source of truth: the DeepSpeed config the ranks read, written by the launch side.
        ds = json.loads((run / "ds_config.json").read_text())
        assert ds["zero_optimization"]["stage"] == stage
        assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (
            16,
            4,
            2,
        )
        assert ds["bf16"]["enabled"] is False and "scheduler" not in ds
        # fp32 weights, 2 micro-batches, 2 ranks: DeepSpeed's own terms (launcher/planner/zero.py::zero_states),
        # the reduce bucket gloo's default, the whole model (stage 3 keeps it for the run)
        bucket = ds["zero_optimization"]["reduce_bucket_size"]
        assert (
            bucket
            == PSI_TINY
            == yaml.safe_load((run / "config.yaml").read_text())["recipe"]["zero"]["reduce_bucket_size"]
        )
        states = zero_states(stage, PSI_TINY, 2, grad_accum=2, weight_bytes=4, bucket=bucket)
        want = sum(d + h for d, h in states.values())
        assert rows[-1]["mem/model_state_bytes"] == pytest.approx(want, rel=0.02), (recipe, rows[-1], want)
        assert rows[-1]["mem/host_bytes"] == 0
    # DeepSpeed's shards inside the Checkpointer's folders: manifest, latest, keep-K.
    ckpts = fp32_runs["zero2"] / "checkpoints"
    assert (ckpts / "latest").read_text().splitlines()[0] == "step_00000020"
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == [f"step_{s:08d}" for s in (5, 10, 15, 20)]
    step = ckpts / "step_00000020"
    assert verify(step) is None
    files = {p.name for p in (step / "engine" / "ds").iterdir()}
    assert {
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    } <= files, files
    assert json.loads((step / "engine" / "zero.json").read_text())["world_size"] == 2
    assert sorted(p.name for p in (step / "trainer").iterdir()) == ["rank_00000.pt", "rank_00001.pt"]


def test_zero_stages_evaluate_ddps_held_out_loss(fp32_runs):
    """train.eval_every under DeepSpeed: each stage's forward-only pass (zero3 gathers its
    partitions for it) gives ddp's val/loss on the same held-out samples; the other engines:
    tests/e2e/test_parallel_train.py."""
    want = evaluated(fp32_runs["ddp"])
    assert sorted(want) == [10, 20] and want[20] < want[10]
    for recipe in ("zero1", "zero2", "zero3"):
        got = evaluated(fp32_runs[recipe])
        assert sorted(got) == [10, 20], (recipe, got)
        assert all(rel(got[s], want[s]) < FP32_REL for s in want), (recipe, got, want)


@contextlib.contextmanager
def read_only_copy(folder: Path, where: Path):
    """A copy of `folder` in `where`, neither of them writable: a read-only bind mount of
    `where` where this process may mount (root), else its modes. Issue 47, 7: resharding
    wrote its scratch beside the source, failing late on a read-only one."""
    import shutil

    copy = shutil.copytree(folder, where / folder.name)
    mounted = subprocess.run(["mount", "--bind", "-o", "ro", str(where), str(where)], capture_output=True)
    if mounted.returncode != 0:
        for p in [where, *where.rglob("*")]:
            p.chmod(p.stat().st_mode & ~0o222)
    try:
        yield copy
    finally:
        if mounted.returncode == 0:
            subprocess.run(["umount", str(where)], capture_output=True)


def test_checkpoint_resumes_at_other_world_sizes_on_the_same_curve(fp32_runs, tmp_path):
    """zero2's step-5 checkpoint (2 ranks) -> 1 rank to step 12 -> 4 ranks to 14 -> 2 ranks
    to 20 (4 ranks on 2 cores step slowest: 2 steps there): every change of world size
    (down, up past the saving one, back) goes through DeepSpeed's universal checkpoint,
    and the losses stay on the uninterrupted 2-rank run's curve."""
    straight = {r["step"]: r for r in read_metrics(fp32_runs["zero2"])}
    run = tmp_path / "chain"
    source = read_only_copy(fp32_runs["zero2"] / "checkpoints" / "step_00000005", tmp_path / "source")
    legs = [(1, 12, f"checkpoint.resume={tmp_path / 'source' / 'step_00000005'}"), (4, 14, None), (2, 20, None)]
    previous = 2
    for nproc, stop, resume in legs:
        extra = [resume] if resume else []
        with source if resume else contextlib.nullcontext():  # the first leg reads a read-only checkpoint
            proc = launch(
                "recipe=zero2",
                *FP32,
                "checkpoint.every=0",
                f"cluster.nproc_per_node={nproc}",
                f"train.stop_at={stop}",
                *extra,
                run_dir=run,
            )
        assert f"resharding a checkpoint of {previous} rank(s) onto {nproc}" in proc.stdout, proc.stdout[-2000:]
        # the scratch in this run's own checkpoint folder, never beside another run's source (issue 47, 7)
        assert f"(DeepSpeed universal checkpoint in {run / 'checkpoints'}/" in proc.stdout, proc.stdout[-2000:]
        assert not list((run / "checkpoints").glob("*.universal.tmp")), "conversion scratch left behind"
        saved = run / "checkpoints" / f"step_{stop:08d}"
        assert json.loads((saved / "engine" / "zero.json").read_text())["world_size"] == nproc
        assert len(list((saved / "trainer").iterdir())) == nproc
        previous = nproc
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(6, 21))
    for r in rows:
        assert rel(r["loss"], straight[r["step"]]["loss"]) < FP32_REL, (
            r["step"],
            r["loss"],
            straight[r["step"]]["loss"],
        )
        assert r["lr"] == straight[r["step"]]["lr"]


def test_export_of_zero_shards_gives_the_trained_model(fp32_runs, tmp_path):
    """`launcher export` on zero2 and zero3 checkpoints: the fp32 weights equal ddp's (the same
    training in fp32), so the exported model gives ddp's logits."""
    from launcher.launch.commands.export import load_exported
    from launcher.models.gpt import GPT

    ddp_dir = fp32_runs["ddp"] / "checkpoints" / "step_00000020" / "engine"
    trained = GPT(C.load_frozen(fp32_runs["ddp"]).model)
    trained.load_state_dict(torch.load(ddp_dir / "model.pt", weights_only=True))
    x = torch.randint(0, 256, (2, 64))
    with torch.no_grad():
        want = trained(x)
    for recipe in ("zero2", "zero3"):
        out = here("export", str(fp32_runs[recipe])).stdout
        path = fp32_runs[recipe] / "export" / "step_00000020" / "model.safetensors"
        assert str(path) in out
        model = load_exported(path)
        for name, p in trained.state_dict().items():
            assert torch.allclose(model.state_dict()[name], p, rtol=0, atol=1e-5), (recipe, name)  # measured 2e-6
        with torch.no_grad():
            assert torch.allclose(model(x), want, rtol=1e-4, atol=1e-4), recipe
    here("export", str(fp32_runs["zero3"]), "export.dtype=bf16", f"export.out={tmp_path / 'bf16'}")
    with torch.no_grad():
        assert torch.allclose(load_exported(tmp_path / "bf16" / "model.safetensors")(x), want, atol=0.05)


OFFLOAD_STEPS = 12


def test_offload_bf16_under_the_deepspeed_launcher_stops_and_resumes(tmp_path):
    """zero3_offload (optimizer and parameters in host memory, DeepSpeedCPUAdam), started by
    `deepspeed`, SIGTERM: every rank saves, exit 75; again, and SIGKILL of the launcher:
    every rank saves and stops; the next launch (torchrun) finishes.
    The bf16 losses stay within BF16_REL of ddp's. Emulated bf16 (no native bf16 on this
    CPU): 12 steps of a quarter of the default batch (4 x 64 tokens a rank) leave room for
    both stops and the resume, and hold every term of the memory checks (parameter-sized)."""
    common = [
        "precision=bf16",
        f"train.steps={OFFLOAD_STEPS}",
        "optim.warmup_steps=3",
        "train.micro_batch=4",
        "train.seq_len=64",
        "logger=none",
        "logger.log_every=1",
        "checkpoint.every=0",
    ]
    launch("recipe=ddp", *common, run_dir=tmp_path / "ddp")
    run = tmp_path / "offload"
    proc = start(run, "recipe=zero3_offload", "cluster.runner=deepspeed", *common)
    # CPU Adam is compiled on first use on a fresh machine (about 75 s, once): generous timeouts.
    wait_for_step(run, 3, proc, timeout=300)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_PREEMPTED, out[-4000:]
    assert "deepspeed.launcher.runner" in (run / "command.sh").read_text()
    marker = json.loads((run / "preempted.json").read_text())
    assert (run / "checkpoints" / "latest").read_text().splitlines()[0] == f"step_{marker['step']:08d}"
    ds = json.loads((run / "ds_config.json").read_text())["zero_optimization"]
    assert ds["offload_optimizer"]["device"] == ds["offload_param"]["device"] == "cpu"

    # SIGKILL of the launcher: DeepSpeed's launch.py would keep the ranks training; they
    # watch the launcher themselves and stop as on SIGTERM (save, preempted.json).
    proc = start(run, "recipe=zero3_offload", "cluster.runner=deepspeed", *common)
    wait_for_step(run, marker["step"] + 1, proc, timeout=300)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 60
    while processes_of(run) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not processes_of(run), "ranks still running after their launcher was killed"
    killed = json.loads((run / "preempted.json").read_text())
    assert marker["step"] < killed["step"] < OFFLOAD_STEPS and killed["signal"] == "SIGTERM", killed
    assert (run / "checkpoints" / "latest").read_text().splitlines()[0] == f"step_{killed['step']:08d}"

    proc2 = launch("recipe=zero3_offload", *common, run_dir=run)  # runner=torchrun this time
    assert f"at step {killed['step']}" in proc2.stdout
    rows, ddp = read_metrics(run), read_metrics(tmp_path / "ddp")
    assert [r["step"] for r in rows] == list(range(1, OFFLOAD_STEPS + 1))
    worst = max(rel(z["loss"], d["loss"]) for z, d in zip(rows, ddp))
    assert worst < BF16_REL, f"bf16 zero3_offload differs from ddp by {worst:.2e}"
    print(f"bf16 zero3_offload against ddp: {worst:.2e} relative at worst over {OFFLOAD_STEPS} steps")
    # optimizer and parameter shards live in host memory: all but the norms and the reduce bucket
    # (gloo's default: the whole model, w x Ψ) kept on the device
    assert ds["reduce_bucket_size"] == PSI_TINY
    want = model_state_bytes(3, PSI_TINY, 2, offload_optimizer=True, offload_param=True, bucket=PSI_TINY)
    assert want["device"] == 2 * PSI_TINY
    for r in rows:
        assert r["mem/host_bytes"] == pytest.approx(want["cpu"], rel=0.02), (r, want)
        assert r["mem/model_state_bytes"] == pytest.approx(want["cpu"] + want["device"], rel=0.03), (r, want)


# ----------------------------------------------------------------------------- memory
# Where DeepSpeed holds more than the paper's figure (> 10%), the measured bytes of the rank
# holding the most (max over ranks, bf16, 2 micro-batches per step) are pinned here, for
# DeepSpeed 0.19.8. The extra term is named by EXTRA; engines.zero.engine.model_state_bytes has the
# true formula, which every measurement must also meet (within 2%: buckets, padding,
# persistent small parameters).
PINNED = {
    ("zero1", "gpt_tiny", 2): 9_808_136,  # gpt_small: 10.999Ψ against 10Ψ, just inside 10%
    ("zero2", "gpt_tiny", 2): 9_808_136,
    ("zero2", "gpt_small", 2): 134_131_976,
    ("zero3", "gpt_tiny", 2): 8_889_352,
    ("zero3", "gpt_small", 2): 122_231_816,
}
EXTRA = {  # (bytes per rank as a function of Ψ and N, name)
    1: (
        lambda p, n: 2 * p + 18 * p / n - (4 * p + 12 * p / n),
        "at the update the bf16 and the fp32 gradient shards (2Ψ/N + 4Ψ/N) outweigh the whole bf16 gradients (2Ψ)",
    ),
    2: (lambda p, n: 4 * p / n, "the fp32 gradient shard DeepSpeed makes for the update (4Ψ/N)"),
    3: (lambda p, n: 4 * p / n, "the fp32 gradient shard DeepSpeed makes for the update (4Ψ/N)"),
}
CASES = [f"{r}:{m}" for m in ("gpt_tiny", "gpt_small") for r in ("ddp", "zero1", "zero2", "zero3")]


OFFLOAD_CASES = ["zero2_offload:gpt_tiny", "zero3_offload:gpt_tiny"]
SMALL_BUCKET = "zero2:recipe.zero.reduce_bucket_size=16384"  # dim^2: the NCCL default of gpt_tiny
HELD = ["zero1", SMALL_BUCKET, "zero2", "zero3"]  # the backward probe's cases: held gradients, collectives


@pytest.fixture(scope="module")
def probed(tmp_path_factory) -> tuple[list[dict], list[dict]]:
    """One 2-rank launch of tests/helpers/zero_memory_probe.py for both probe tests: every
    CASES and OFFLOAD_CASES engine's bytes, then (--held) zero_backward_probe.py's gradients
    held when backward ends for HELD: (memory results, held per rank)."""
    folder = tmp_path_factory.mktemp("zero-probes")
    out, held = folder / "memory-2.json", folder / "held.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "tests/helpers/zero_memory_probe.py",
            str(out),
            *CASES,
            *OFFLOAD_CASES,
            "--held",
            str(held),
            *HELD,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(out.read_text()), json.loads(held.read_text())["ranks"]


def test_model_state_bytes_per_rank_against_the_zero_paper(probed):
    """Two ranks, bf16, tiny and small: the paper's figure, what DeepSpeed holds beyond it
    (pinned, the term named), the losses and weights of ddp. Every other world size,
    precision and accumulation is in tests/e2e/test_plan_runs.py's matrix."""
    nproc = 2
    results, _ = probed
    assert [f"{r['recipe']}:{r['model']}" for r in results] == CASES + OFFLOAD_CASES
    losses = {r["model"]: r["losses"] for r in results if r["recipe"] == "ddp"}
    for r in results:
        recipe, model, psi, n = r["recipe"], r["model"], r["psi"], r["world_size"]
        assert n == nproc and len(r["ranks"]) == nproc
        # bf16 steps of every recipe on the same batches: ddp's loss (the first step is equal).
        assert all(rel(a, b) < BF16_REL for a, b in zip(r["losses"], losses[model])), (recipe, model, r["losses"])
        # consolidated_state_dict(): every weight whole, in place (init std 0.02; two steps of lr 3e-3)
        assert r["weight_names_match"] and r["max_weight_diff"] < 1e-3, (recipe, model, r["max_weight_diff"])
        if recipe == "ddp":
            continue
        stage = 3 if recipe.startswith("zero3") else int(recipe[4])
        measured = max(x["total"] for x in r["ranks"])
        where = r["ranks"][0]["where"]
        true = model_state_bytes(
            stage,
            psi,
            n,
            grad_accum=2,
            offload_optimizer="offload" in recipe,
            offload_param=recipe == "zero3_offload",
            largest_param=r["largest_param"],
        )
        host = max(x["host"] for x in r["ranks"])
        assert measured == pytest.approx(true["device"] + true["cpu"], rel=0.02), (recipe, model, n, measured / psi)
        assert host == pytest.approx(true["cpu"], rel=0.02, abs=0.002 * psi), (recipe, model, n, host / psi)
        if "offload" in recipe:
            assert where["optim"] == "cpu" and "cpu" in where["grads"], where
            # zero3_offload: the weight shards in host memory (the persistent norms stay on the
            # device); zero2_offload: the 16-bit weights on the device, the 16-bit upload buffer
            # (DeepSpeed's temp_buffer_bit16, on the partition's device) pinned in host memory
            assert where["params"] == "device+cpu", where
            continue
        assert where == {"params": "device", "grads": "device", "optim": "device"}
        paper = paper_bytes(stage, psi, n)
        if abs(measured / paper - 1) <= 0.10:
            assert (recipe, model, n) not in PINNED
            continue
        assert measured == PINNED[(recipe, model, n)], (recipe, model, n, measured)
        extra, _name = EXTRA[stage]
        # what is left after the named term: buckets, padding, persistent parameters (< 0.7% pinned)
        assert measured - paper == pytest.approx(extra(psi, n), abs=0.008 * measured), (recipe, model, n, _name)


def test_zero1_holds_the_whole_gradients_when_backward_ends(probed):
    """One micro-batch a step on two ranks: when backward ends, zero1 holds every gradient
    whole (it reduces them only then), zero2 with buckets of dim^2 little more than its shard
    (its buckets reduced the rest as backward made them; the last bucket's are still whole).
    The planner's gradients at their
    peak (footprint.grads_at_peak) hold the whole ones for zero1, at any world size: on 8 ranks
    of gpt_7b with full recomputation they, not the activations, set the step's peak."""
    from launcher.launch import cli
    from launcher.planner import plan as planner
    from launcher.planner.memory import ParamCounts

    _, ranks = probed  # measured in the memory probe's launch, after its engines
    assert [r["zero1"]["held"] for r in ranks] == [PSI_TINY] * 2
    assert all(r[SMALL_BUCKET]["held"] < 0.6 * PSI_TINY for r in ranks), ranks  # measured: 0.52 and 0.57
    for world, model in ((2, "gpt_tiny"), (8, "gpt_7b")):
        cfg, _, _ = cli.compose_config(
            [
                "recipe=zero1",
                f"model={model}",
                "precision=bf16",
                "train.micro_batch=1",
                "train.activation_checkpointing=full",
            ]
        )
        row = planner.memory_row(cfg, planner.layout_for(cfg, world), cfg.train.activation_checkpointing, 1)
        assert row.grads_peak >= 2 * ParamCounts.of(cfg.model).total, (model, world)
    assert row.total >= row.params + row.optim + row.grads_peak > row.params + row.optim + row.activations


def test_the_planner_counts_deepspeeds_collectives(probed):
    """The collectives of one step as DeepSpeed 0.19 launches them on 2 gloo ranks, against
    launcher/planner/collectives.py::per_step. zero1/2 reduce their gradients with an
    all-reduce per bucket (use_multi_rank_bucket_allreduce), never a reduce-scatter, and
    share the updated weights in one all-gather per parameter group (2: matrices, vectors),
    whatever allgather_bucket_size says. gloo's default bucket (the whole model) makes the
    reduction one message, where buckets of dim^2 (the NCCL default) make 31-39 of them;
    zero3 reduce-scatters every gradient, in one message under gloo's default."""
    sys.path.insert(0, str(REPO / "tests" / "helpers"))
    from zero_backward_probe import case_config

    from launcher.planner import collectives
    from launcher.planner import plan as planner

    for case, seen in probed[1][0].items():
        cfg = case_config(case, 2)
        planned = collectives.per_step(cfg, planner.layout_for(cfg, 2))
        launched: dict[str, list[int]] = {}
        for kind, n in seen["collectives"]:
            launched.setdefault(kind, []).append(n)
        assert set(launched) == set(planned), (case, launched, planned)
        total = {k: sum(v) for k, v in launched.items()}
        if case.startswith(("zero1", "zero2")):
            assert total["all_reduce"] == total["all_gather"] == PSI_TINY, case  # every gradient, every weight
            assert len(launched["all_gather"]) == planned["all_gather"]["count"] == 2, case
            many = case == SMALL_BUCKET
            assert (len(launched["all_reduce"]) > 1) is many and (planned["all_reduce"]["count"] > 1) is many, case
            if not many:
                assert len(launched["all_reduce"]) == planned["all_reduce"]["count"] == 1, case
        else:  # the reduce-scatter's output: each rank's half of every gradient
            assert 2 * total["reduce_scatter"] == PSI_TINY, case
            assert len(launched["reduce_scatter"]) == planned["reduce_scatter"]["count"] == 1, case

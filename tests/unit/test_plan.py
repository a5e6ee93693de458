"""The memory planner without a training run: formulas against autograd, the table, JSON and
chart, start-up, auto choices. The plan against measured engines in every cell:
tests/e2e/test_plan_runs.py."""

from __future__ import annotations

import json
import shlex
import subprocess

import pytest
import torch
from runs import here

from launcher.config import ACMode, num_params
from launcher.launch import cli, compose
from launcher.models.gpt import GPT, set_activation_checkpointing
from launcher.planner import plan as planner
from launcher.planner import zero
from launcher.planner.footprint import activations
from launcher.planner.memory import ActivationCounter, Numerics, ParamCounts, activation_bytes

REGIMES = {  # name -> (how the model runs, what the formula is told)
    "autocast-bf16": (torch.bfloat16, False, Numerics.of("bf16")),
    "bf16-params": (None, True, Numerics.of("bf16", low_precision_params=True, rope_cast=True)),
    "fp32": (None, False, Numerics.of("fp32")),
}


@pytest.mark.parametrize("regime", sorted(REGIMES))
@pytest.mark.parametrize(
    "model",
    [
        ["model=gpt_tiny"],
        ["model=gpt_small"],
        ["model=gpt_tiny", "model.n_kv_heads=2", "model.tie_embeddings=false", "model.n_layers=5"],
    ],
    ids=["tiny", "small", "tiny-gqa-untied"],
)
def test_activation_formula_matches_autograd(regime, model):
    """Predicted activation bytes = what saved_tensors_hooks count, to the byte (bar the
    loss's 12: the fp32 weight total of its sum and the int64 count it divides by, which
    keeps a window with nothing counted at 0), in every numerics regime, with and without
    checkpointing."""
    autocast, cast_module, numerics = REGIMES[regime]
    cfg, _, _ = cli.compose_config(model)
    torch.manual_seed(0)
    m = GPT(cfg.model)
    if cast_module:
        m = m.to(torch.bfloat16)
    for ac in (ACMode.none, ACMode.selective, ACMode.full):
        for b in (2, 4) if "small" not in str(model) else (2,):
            set_activation_checkpointing(m, ac, 2)
            x = torch.randint(0, 256, (b, 65))
            with ActivationCounter(m) as counter:
                with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                    loss = m(x[:, :-1], x[:, 1:])
                loss.backward()
            predicted = activation_bytes(cfg.model, b, 64, numerics, ac, ac_every=2)
            assert abs(predicted - counter.bytes) <= 12, (ac, b, predicted, counter.bytes)


def test_meta_device_counts_a_70b_model_without_memory():
    cfg, _, _ = cli.compose_config(
        [
            "model=gpt_7b",
            "model.dim=8192",
            "model.n_layers=80",
            "model.n_heads=64",
            "model.n_kv_heads=8",
            "model.ffn_dim=28672",
        ]
    )
    counts = ParamCounts.of(cfg.model)
    assert counts.total == num_params(cfg.model) == 68_976_648_192  # Llama-2-70B's count


def run_plan(*overrides: str) -> subprocess.CompletedProcess:
    """`launcher plan` in this process (README's `make plan` line runs it as a command:
    tests/e2e/test_readme.py)."""
    return here("plan", *overrides)


def test_plan_table_json_and_chart(tmp_path):
    chart = tmp_path / "plan.png"
    args = [
        "model=gpt_7b",
        "cluster.nnodes=1",
        "cluster.gpus_per_node=8",
        "cluster.gpu_memory_gb=80",
        "train.seq_len=4096",
    ]
    data = json.loads(run_plan(*args, "--json", f"plan.chart={chart}").stdout)
    rows = data["rows"]
    recipes = sorted(p.stem for p in (compose.CONF_DIR / "recipe").glob("*.yaml"))
    assert {r["layout"]["recipe"] for r in rows} == set(recipes)
    assert {r["ac"] for r in rows} == {"none", "op", "selective", "full"}
    best = [r for r in rows if r["recommended"]]
    budget = data["gpu_bytes"] - 2 * 2**30
    for r in rows:
        on_device = sum(r[k] - r["host"][k] for k in ("params", "grads", "optim"))
        for k in ("params", "grads", "optim"):  # offload: which parts live in host memory, and how much
            assert (r["host"][k] == 0) == (r["where"][k] == "device")
            assert (r["host"][k] == r[k]) == (r["where"][k] == "cpu")
        grads = r["grads"] - r["host"]["grads"]
        assert grads <= r["grads_peak"] and r["grads_kept"] <= grads
        assert r["total"] == on_device - grads + max(r["grads_peak"], r["grads_kept"] + r["activations"]) + r["temp"]
        # An engine that frees its gradients between steps keeps fewer of them beside the activations.
        assert (r["grads_kept"] < grads) == r["layout"]["grads_freed"] or grads == 0
        assert r["peak"] == max(r["total"], r["startup"]) and r["startup"] > 0 or r["layout"]["offload_params"]
        assert r["fits"] == (r["peak"] <= budget)
    if any(r["fits"] for r in rows):
        assert len(best) == 1 and best[0]["cost"] == 1.0
        assert all(r["cost"] >= 1.0 for r in rows if r["fits"])
    assert chart.stat().st_size > 10_000 and chart.read_bytes()[:4] == b"\x89PNG"
    table = run_plan(*args).stdout
    assert "params" in table and "activations" in table and "headroom" in table and "start-up" in table
    # The recommended command, pasted, trains the planned row: the user's model and sequence
    # length with the plan's recipe, degrees, checkpointing and micro-batch.
    line = next(x for x in table.splitlines() if x.startswith("recommended: make train RECIPE="))
    recipe, rest = line.removeprefix("recommended: make train RECIPE=").split(" ", 1)
    assert rest.startswith('ARGS="') and rest.endswith('"')
    cfg, _, _ = cli.compose_config([f"recipe={recipe}", *shlex.split(rest[len('ARGS="') : -1])])
    b = best[0]
    assert (cfg.recipe.name, cfg.model.name, cfg.train.seq_len) == (b["layout"]["recipe"], "gpt_7b", 4096)
    assert (cfg.train.activation_checkpointing.value, cfg.train.micro_batch) == (b["ac"], b["micro_batch"])
    assert (cfg.parallel.tp, cfg.parallel.pp) == (b["layout"]["tp"], b["layout"]["pp"])


def test_start_up_column_for_a_7b_model_on_24_gib_gpus():
    """Built on meta and sharded before anything is allocated, fsdp starts with 4Ψ/8 on
    each of 8 GPUs (before: the whole fp32 model, 25 GiB, on every one), ddp with the
    whole model and its buckets; the offload recipes' host memory per node is refused
    when the node does not have it, and allowed when it does."""
    args = ["model=gpt_7b", "cluster.gpus_per_node=8", "cluster.gpu_memory_gb=24", "--json"]
    psi = ParamCounts.of(cli.compose_config(["model=gpt_7b"])[0].model).total
    rows = json.loads(run_plan(*args).stdout)["rows"]
    by = {r["layout"]["label"]: r for r in rows if r["ac"] == "full"}
    assert by["fsdp (dp8)"]["startup"] == 4 * psi // 8 and by["fsdp (dp8)"]["fits"]
    assert by["ddp (dp8)"]["startup"] == 8 * psi
    # bf16: 2 + 2 + 4 bytes per Ψ/N, and the set-up's fp32 gradient buffer of the largest
    # optimizer sub-group S (here the matrices' partition: Ψ/N is below sub_group_size)
    S = zero.sub_group(cli.compose_config(["model=gpt_7b", "recipe=zero3"])[0], 8, psi)
    assert by["zero3 (dp8)"]["startup"] == 2 * (2 * psi // 8) + 4 * psi // 8 + 4 * S and S < psi // 8
    offload = [r for r in rows if r["layout"]["recipe"] in ("zero2_offload", "zero3_offload")]
    assert all(r["startup_host_node"] > 16 * 2**30 for r in offload) and any(r["fits"] for r in offload)
    small_host = json.loads(run_plan(*args, "plan.host_memory_gb=16").stdout)["rows"]
    assert not any(r["fits"] for r in small_host if r["layout"]["recipe"] in ("zero2_offload", "zero3_offload"))
    assert any(r["recommended"] for r in small_host)  # something that can start is still recommended
    # The step's offloaded states count too: 96 GiB holds zero2_offload's start-up (52 GiB
    # a node) but not its optimizer states in host memory during the step (115 GiB a node).
    mid_host = json.loads(run_plan(*args, "plan.host_memory_gb=96").stdout)["rows"]
    assert not any(r["fits"] for r in mid_host if r["layout"]["recipe"] == "zero2_offload")


def test_activation_checkpointing_shrinks_the_plan():
    data = json.loads(
        run_plan(
            "model=gpt_1b", "cluster.gpus_per_node=8", "cluster.gpu_memory_gb=80", "train.seq_len=2048", "--json"
        ).stdout
    )
    ddp = {r["ac"]: r for r in data["rows"] if r["layout"]["recipe"] == "ddp"}
    assert ddp["full"]["micro_batch"] > ddp["selective"]["micro_batch"] > ddp["none"]["micro_batch"] >= 1


def test_context_parallel_splits_activations_and_fsdp_shards_over_it(capsys):
    """parallel.cp=2 on 8 GPUs: the recipes that split the sequence plan it (dp4 cp2), the
    others plan without it; a cp rank saves half the activations of the whole sequence (the
    block's one extra exchanged tensor aside) and FSDP shards its states over dp x cp."""
    args = (
        "model=llama3_8b",
        "cluster.gpus_per_node=8",
        "cluster.gpu_memory_gb=80",
        "train.seq_len=8192",
        "train.micro_batch=1",
        "--json",
    )
    whole, split = (json.loads(run_plan(*args, *extra).stdout)["rows"] for extra in ((), ("parallel.cp=2",)))

    def row(rows, recipe, cp, ac="none"):
        return next(
            r
            for r in rows
            if r["layout"]["recipe"] == recipe and r["layout"]["cp"] == cp and r["layout"]["tp"] == 1 and r["ac"] == ac
        )

    assert {r["layout"]["recipe"] for r in split if r["layout"]["cp"] == 2} == {"ddp", "fsdp", "tp_fsdp"}
    assert all(r["layout"]["cp"] == 1 for r in split if r["layout"]["recipe"] not in ("ddp", "fsdp", "tp_fsdp"))
    a, b = row(whole, "fsdp", 1), row(split, "fsdp", 2)
    assert (a["layout"]["dp"], b["layout"]["dp"]) == (8, 4) and b["params"] == a["params"]  # shards over 8 either way
    for recipe in ("fsdp", "ddp"):
        x, y = (
            activations(cfg, planner.layout_for(cfg, 8), ACMode.none, 1)
            for cfg in (
                cli.compose_config([f"recipe={recipe}", "precision=fp32", *args[:4], *cp])[0]
                for cp in ([], ["parallel.cp=2"])
            )
        )
        assert 0.5 < y / x < 0.56, (
            recipe,
            y / x,
        )  # not shrinking: the rope table, FSDP's gathered head, autocast's weight copies
    assert b["layout"]["overrides"] == ["recipe=fsdp", "parallel.cp=2"] and b["layout"]["label"] == "fsdp (dp4 cp2)"


def test_nothing_fits_gets_an_answer_not_a_crash(tmp_path, capsys, monkeypatch):
    # Even zero3_offload (every model state in host memory) needs a layer gathered and the logits.
    out = run_plan("model=gpt_7b", "cluster.gpus_per_node=1", "cluster.gpu_memory_gb=1").stdout
    assert "nothing fits in 1 GiB per GPU" in out and "needs GPUs with at least" in out
    monkeypatch.chdir(tmp_path)
    code = cli.main(
        ["train", "recipe=auto", "model=gpt_7b", "cluster.gpu_memory_gb=1", f"hydra.run.dir={tmp_path / 'run'}"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "recipe=auto: nothing fits" in err[0]
    assert not (tmp_path / "run").exists()


def test_auto_recipe_on_a_machine_without_gpus_plans_for_its_memory(tmp_path, capsys, monkeypatch):
    """`make train RECIPE=auto` as the README shows it, here: the ranks run on the CPU, so
    each gets its share of this machine's memory; offloading to that memory is no choice."""
    if torch.cuda.is_available():
        pytest.skip("a machine without GPUs")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "recipe=auto", "--dry-run", f"hydra.run.dir={tmp_path / 'run'}"]) == 0
    out = capsys.readouterr().out
    chose = next(line for line in out.splitlines() if line.startswith("planner chose: "))
    assert "GiB per rank: this machine's memory, shared" in chose and "offload" not in chose
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("native", [True, False])
def test_auto_micro_batch_plans_the_recipe_as_overridden(tmp_path, capsys, monkeypatch, native):
    """train.micro_batch=auto with the recipe's own options overridden: the planner plans
    the recipe as composed (here zero2 with its optimizer on the host), not its file; and in
    the precision the launch runs (fp32 on a CPU without native bf16: planned in bf16, its
    choice was refused by the launch's own memory check)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("launcher.host.native_bf16", lambda *a: native)
    argv = [
        "train",
        "recipe=zero2",
        "recipe.zero.offload_optimizer=cpu",
        "train.micro_batch=auto",
        "--dry-run",
        "cluster.gpu_memory_gb=8",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    assert cli.main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    chose = next(line for line in out.splitlines() if line.startswith("planner chose: "))
    assert chose.startswith("planner chose: zero2 (dp2)"), chose
    assert "  oom_backoff: true\n" in out  # should a step not fit after all: the back-off keeps the batch
    hw = planner.Hardware(gpu_bytes=80 * 2**30, gpus_per_node=2, nnodes=1, tflops=planner.DEFAULT_TFLOPS)
    cfg, _, _ = cli.compose_config(["recipe=zero2", "recipe.zero.offload_optimizer=cpu"])
    assert (
        planner.layout_for(cfg, 2).offload_optim
        and not planner.layout_for(cli.compose_config(["recipe=zero2"])[0], 2).offload_optim
    )
    assert planner.no_fit_message([], hw, 0).startswith("no layout")


def test_plan_without_a_gpu_size_is_refused_in_one_line(capsys):
    assert cli.main(["plan", "model=gpt_7b", "cluster.gpus_per_node=8"]) == 2
    assert "cluster.gpu_memory_gb" in capsys.readouterr().err


"""At 4 ranks fp32 only: every term that depends on the world size is met in fp32 there,
and each precision's terms at 1 and 2 ranks (half the 4-rank cost, about 100 s)."""

"""The memory planner: formulas against real measurements, the table, auto choices."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest
import torch

from conftest import REPO, launch, read_metrics
from launcher import cli
from launcher import plan as planner
from launcher.config import ACMode
from launcher.memory import ActivationCounter, Numerics, ParamCounts, activation_bytes
from launcher.models.gpt import GPT, num_params, set_activation_checkpointing

REGIMES = {  # name -> (how the model runs, what the formula is told)
    "autocast-bf16": (torch.bfloat16, False, Numerics.of("bf16")),
    "bf16-params": (None, True, Numerics.of("bf16", low_precision_params=True, rope_cast=True)),
    "fp32": (None, False, Numerics.of("fp32")),
}


@pytest.mark.parametrize("regime", sorted(REGIMES))
@pytest.mark.parametrize("model", [["model=gpt_tiny"], ["model=gpt_small"],
                                   ["model=gpt_tiny", "model.n_kv_heads=2", "model.tie_embeddings=false",
                                    "model.n_layers=5"]], ids=["tiny", "small", "tiny-gqa-untied"])
def test_activation_formula_matches_autograd(regime, model):
    """Predicted activation bytes = what saved_tensors_hooks count, to the byte (bar the
    4-byte loss), in every numerics regime, with and without checkpointing."""
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
            assert abs(predicted - counter.bytes) <= 4, (ac, b, predicted, counter.bytes)


def test_meta_device_counts_a_70b_model_without_memory():
    cfg, _, _ = cli.compose_config(["model=gpt_7b", "model.dim=8192", "model.n_layers=80", "model.n_heads=64",
                                    "model.n_kv_heads=8", "model.ffn_dim=28672"])
    counts = ParamCounts.of(cfg.model)
    assert counts.total == num_params(cfg.model) == 68_976_648_192  # Llama-2-70B's count


def run_plan(*overrides: str) -> subprocess.CompletedProcess:
    return launch(*overrides, command="plan")


def test_plan_table_json_and_chart(tmp_path):
    chart = tmp_path / "plan.png"
    args = ["model=gpt_7b", "cluster.nnodes=1", "cluster.gpus_per_node=8", "cluster.gpu_memory_gb=80",
            "train.seq_len=4096"]
    data = json.loads(run_plan(*args, "--json", f"plan.chart={chart}").stdout)
    rows = data["rows"]
    recipes = sorted(p.stem for p in (cli.CONF_DIR / "recipe").glob("*.yaml"))
    assert {r["layout"]["recipe"] for r in rows} == set(recipes)
    assert {r["ac"] for r in rows} == {"none", "selective", "full"}
    best = [r for r in rows if r["recommended"]]
    budget = data["gpu_bytes"] - 2 * 2**30
    for r in rows:
        on_device = sum(r[k] - r["host"][k] for k in ("params", "grads", "optim"))
        for k in ("params", "grads", "optim"):  # offload: which parts live in host memory, and how much
            assert (r["host"][k] == 0) == (r["where"][k] == "device")
            assert (r["host"][k] == r[k]) == (r["where"][k] == "cpu")
        assert r["total"] == on_device + r["activations"] + r["temp"]
        assert r["peak"] == max(r["total"], r["startup"]) and r["startup"] > 0 or r["layout"]["offload_params"]
        assert r["fits"] == (r["peak"] <= budget)
    if any(r["fits"] for r in rows):
        assert len(best) == 1 and best[0]["cost"] == 1.0
        assert all(r["cost"] >= 1.0 for r in rows if r["fits"])
    assert chart.stat().st_size > 10_000 and chart.read_bytes()[:4] == b"\x89PNG"
    table = run_plan(*args).stdout
    assert "params" in table and "activations" in table and "headroom" in table and "start-up" in table


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
    assert by["zero3 (dp8)"]["startup"] == 12 * psi // 8  # bf16: 2 + 2 + 4 + 4 bytes per Ψ/N
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
    data = json.loads(run_plan("model=gpt_1b", "cluster.gpus_per_node=8", "cluster.gpu_memory_gb=80",
                               "train.seq_len=2048", "--json").stdout)
    ddp = {r["ac"]: r for r in data["rows"] if r["layout"]["recipe"] == "ddp"}
    assert ddp["full"]["micro_batch"] > ddp["selective"]["micro_batch"] > ddp["none"]["micro_batch"] >= 1


def test_nothing_fits_gets_an_answer_not_a_crash(tmp_path, capsys, monkeypatch):
    # Even zero3_offload (every model state in host memory) needs a layer gathered and the logits.
    out = run_plan("model=gpt_7b", "cluster.gpus_per_node=1", "cluster.gpu_memory_gb=1").stdout
    assert "nothing fits in 1 GiB per GPU" in out and "needs GPUs with at least" in out
    monkeypatch.chdir(tmp_path)
    code = cli.main(["train", "recipe=auto", "model=gpt_7b", "cluster.gpu_memory_gb=1",
                     f"hydra.run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "recipe=auto: nothing fits" in err[0]
    assert not (tmp_path / "run").exists()


def test_plan_without_a_gpu_size_is_refused_in_one_line(capsys):
    assert cli.main(["plan", "model=gpt_7b", "cluster.gpus_per_node=8"]) == 2
    assert "cluster.gpu_memory_gb" in capsys.readouterr().err


# ----------------------------------------------------------------------------- real ranks
@pytest.mark.slow
def test_predictions_match_what_two_ranks_hold_and_save(tmp_path):
    """Every landed recipe at 2 ranks, tiny and small, two micro-batches, with and without
    checkpointing: model states within 5% of state_bytes(), activations within 15% of
    what autograd saves. (The offload recipes' states are the same formula, checked in
    tests/test_zero.py; their activations are zero2's and zero3's.)"""
    out = tmp_path / "mem.json"
    recipes = ",".join(sorted(p.stem for p in (cli.CONF_DIR / "recipe").glob("*.yaml") if "offload" not in p.stem))
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                    "scripts/measure_memory.py", "--recipes", recipes, "--out", str(out)],
                   cwd=REPO, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=900)
    rows = json.loads(out.read_text())
    assert len(rows) == 2 * len(recipes.split(",")) * 2 * 2 * 2
    for r in rows:
        m, p = r["measured"], r["predicted"]
        where = f"{r['recipe']} {r['model']} mb={r['micro_batch']} ac={r['ac']} rank={r['rank']}"
        assert abs(m["model_state"] / p["model_state"] - 1) <= 0.05, (where, m, p)
        assert abs(m["activations"] / p["activations"] - 1) <= 0.15, (where, m, p)


@pytest.mark.slow
def test_auto_recipe_and_micro_batch_train(run_dir):
    proc = launch("recipe=auto", "train.micro_batch=auto", "cluster.gpu_memory_gb=0.2", "plan.reserve_gb=0",
                  "train.steps=6", "optim.warmup_steps=1", "logger=none", "logger.log_every=1", run_dir=run_dir)
    assert "planner chose:" in proc.stdout
    record = json.loads((run_dir / "plan.json").read_text())
    chosen = dict(o.split("=", 1) for o in record["chosen"])
    frozen = (run_dir / "config.yaml").read_text()
    assert f"micro_batch: {chosen['train.micro_batch']}" in frozen
    assert int(chosen["train.micro_batch"]) > 8  # 0.2 GiB holds far more than the default 8 for gpt_tiny
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, 7))


def _limit_address_space(gib: float):
    def apply():
        resource.setrlimit(resource.RLIMIT_AS, (int(gib * 2**30), int(gib * 2**30)))
    return apply


@pytest.mark.slow
def test_out_of_memory_backs_off_the_micro_batch(run_dir):
    """A real allocation failure: the ranks run under an address-space limit, the planner
    (told the device is large) starts too big, a rank fails to allocate, the launcher
    halves the micro-batch and relaunches until the step fits."""
    argv = [sys.executable, "-m", "launcher", "train", f"hydra.run.dir={run_dir}", "model=gpt_small",
            "train.micro_batch=auto", "cluster.gpu_memory_gb=1.6", "plan.reserve_gb=0", "train.steps=2", "optim.warmup_steps=1",
            "logger=none", "train.seq_len=256", "plan.max_micro_batch=256"]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600,
                          preexec_fn=_limit_address_space(2.2))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "out of memory: retrying with train.micro_batch=" in proc.stdout
    settled = int(proc.stdout.split("micro-batch settled at ")[1].split()[0])
    assert settled < 256 and f"micro_batch: {settled}" in (run_dir / "config.yaml").read_text()
    assert [r["step"] for r in read_metrics(run_dir)][-1] == 2

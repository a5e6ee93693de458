"""A mixture of experts in the planner (launcher/planner/moe.py): parameter counts, each
group's states over its own ranks, the MoE block's activations against autograd, the
dispatch bounds, the all-to-all time. The plan against real MoE ranks:
tests/e2e/test_plan_runs.py::test_the_plan_holds_for_an_moe."""

from __future__ import annotations

import json
import math

import pytest
import torch
from runs import here

from launcher import models
from launcher.config import ACMode, matmul_params, num_params
from launcher.launch import cli
from launcher.models.gpt import GPT, flops_per_token, set_activation_checkpointing
from launcher.planner import cost, footprint, moe
from launcher.planner import plan as planner
from launcher.planner.memory import ActivationCounter, Numerics, ParamCounts, Shape, activation_bytes


def model(*overrides: str):
    return cli.compose_config(list(overrides))[0]


def meta_count(cfg) -> int:
    """Parameters of the ranks' own build on the meta device (launcher.models.on_meta)."""
    return sum(p.numel() for p in models.on_meta(cfg).parameters())


def test_mixtral_and_deepseek_counts_total_active_and_per_block():
    mixtral = model("model=mixtral_8x7b")
    c = ParamCounts.of(mixtral.model)
    assert c.total == num_params(mixtral.model) == meta_count(mixtral) == 46_702_792_704
    assert num_params(mixtral.model, active=True) == 12_879_925_248
    assert c.expert_total == 32 * 3 * 8 * 4096 * 14336 and set(c.blocks) == {c.blocks[0]}

    ds = model("model=deepseek_v3")
    c = ParamCounts.of(ds.model)
    assert c.total == num_params(ds.model) == meta_count(ds)
    dense, moe_block = c.blocks[0], c.blocks[3]
    assert c.blocks == (dense,) * 3 + (moe_block,) * 58 and dense < moe_block
    assert c.experts == (0,) * 3 + (256 * 3 * 7168 * 2048,) * 58
    from launcher.planner.memory import param_summary

    summary = param_summary(ds.model)
    assert [(r["kind"], r["count"]) for r in summary["blocks"]] == [("dense", 3), ("moe", 58)]
    assert summary["active"] == num_params(ds.model, active=True) < summary["total"] == c.total


def states(cfg, layout):
    p, g, o, _, _ = footprint.model_states(cfg, layout)
    return p, g, o


def test_each_group_over_its_own_ranks():
    """Dense weights over the dp ranks, the experts over ep x the rest: fsdp holds the rank-0
    shard of each stacked expert weight (E/ep over n/ep ranks: whole experts, or on dimension 1
    where the ranks outnumber them), ddp E/ep experts."""
    cfg = model("model=mixtral_8x7b")
    c = ParamCounts.of(cfg.model)
    dense, experts = c.total - c.expert_total, c.expert_total
    fsdp = dict(shard="zero3", fsdp=True)
    # 8 experts on 16 ranks (ep=1): cut on dimension 1, every rank its 16th of each expert (the mean)
    S = dense // 16 + experts // 16
    assert states(cfg, footprint.Layout("fsdp", dp=16, **fsdp)) == (4 * S, 4 * S, 8 * S)
    # ep=8 on 64: each ep rank 1 expert, over 8 ranks: its 8th on dimension 1 (the mean again)
    S = dense // 64 + experts // 64
    assert states(cfg, footprint.Layout("fsdp", dp=64, ep=8, **fsdp))[0] == 4 * S
    # 8 ranks: one expert each whatever ep: the mean
    assert states(cfg, footprint.Layout("fsdp", dp=8, ep=8, **fsdp))[0] == 4 * (dense // 8 + experts // 8)
    # ddp: dense replicated, E/ep experts; start-up's buckets leave the experts out under ep
    P = dense + experts // 8
    assert states(cfg, footprint.Layout("ddp", dp=16, ep=8, grad_buckets=True)) == (4 * P, 4 * P, 8 * P)
    assert footprint.start_up(cfg, footprint.Layout("ddp", dp=16, ep=8, grad_buckets=True))[0] == 4 * P + 4 * dense
    # ZeRO (ep=1): the dense formulas over the whole model
    ds = model("model=deepseek_v3")
    psi = ParamCounts.of(ds.model).total
    p, g, o = states(ds, footprint.Layout("zero3", dp=256, shard="zero3"))
    assert o == 12 * psi // 256 and p >= 2 * psi // 256
    # DeepSeek-V3 on 256 ranks, ep=64: 4 experts a rank over 4 ranks, one row each: the mean
    c = ParamCounts.of(ds.model)
    S = (c.total - c.expert_total) // 256 + c.expert_total // 256
    assert states(ds, footprint.Layout("fsdp", dp=256, ep=64, **fsdp))[0] == 4 * S


REGIMES = {
    "fp32": (False, Numerics.of("fp32")),
    "bf16-params": (True, Numerics.of("bf16", low_precision_params=True, rope_cast=True)),
}
SHAPES = {
    "moe_tiny": [],
    "shared-first-dense-sigmoid-bias": [
        "model.moe.shared_experts=1",
        "model.moe.first_dense=1",
        "model.moe.score=sigmoid",
        "model.moe.balance=bias",
        "model.moe.route_scale=2.5",
    ],
    "softmax-aux-top1": ["model.moe.top_k=1", "model.moe.shared_experts=2"],
}


@pytest.mark.parametrize("regime", sorted(REGIMES))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_moe_activations_match_autograd(regime, shape):
    """The MoE block's saved tensors (router scores, indices, gathered rows, the experts'
    SwiGLU, the combine) to the byte (bar the loss's 12), with and without checkpointing;
    with a capacity factor the plan is the bound (what the experts could take)."""
    cast, numerics = REGIMES[regime]
    cfg = model("model=moe_tiny", *SHAPES[shape])
    torch.manual_seed(0)
    m = GPT(cfg.model)
    m = m.to(torch.bfloat16) if cast else m
    for ac in (ACMode.none, ACMode.selective, ACMode.full):
        set_activation_checkpointing(m, ac, 2)
        x = torch.randint(0, 256, (2, 65))
        with ActivationCounter(m) as counter:
            m(x[:, :-1], x[:, 1:]).backward()
        planned = activation_bytes(cfg.model, 2, 64, numerics, ac) + moe.activation_delta(
            cfg.model, Shape.of(cfg.model, 2, 64), numerics, ac, 2
        )
        assert abs(planned - counter.bytes) <= 12, (ac, planned, counter.bytes)


def test_capacity_bounds_the_rows():
    cfg = model("model=moe_tiny", "model.moe.capacity_factor=0.5")
    torch.manual_seed(0)
    m = GPT(cfg.model)
    x = torch.randint(0, 256, (2, 65))
    with ActivationCounter(m) as counter:
        m(x[:, :-1], x[:, 1:]).backward()
    planned = activation_bytes(cfg.model, 2, 64, Numerics.of("fp32"), ACMode.none) + moe.activation_delta(
        cfg.model, Shape.of(cfg.model, 2, 64), Numerics.of("fp32"), ACMode.none, 2
    )
    assert counter.bytes <= planned < 1.15 * counter.bytes
    assert moe.rows(cfg.model, 128) == 8 * math.ceil(0.5 * 128 * 2 / 8) == 128  # E x capacity


def test_dispatch_rows_balanced_capacity_and_worst():
    mixtral, ds = model("model=mixtral_8x7b").model, model("model=deepseek_v3").model
    N = 8192
    assert moe.rows(mixtral, N) == moe.rows(mixtral, N, ep=1, worst=True) == 2 * N  # ep=1: N k whatever the routing
    assert moe.rows(mixtral, N, ep=8, worst=True) == 8 * N * 1  # one expert a rank: a token sends it one row
    assert moe.rows(ds, N, ep=64, worst=True) == 64 * N * 4  # 4 experts a rank, top-8
    assert moe.rows(ds, N, ep=8, worst=True) == 8 * N * 8
    capped = model("model=deepseek_v3", "model.moe.capacity_factor=1.25").model
    assert moe.rows(capped, N, ep=64) == 256 * math.ceil(1.25 * N * 8 / 256) == moe.rows(capped, N, ep=64, worst=True)
    x, n = Shape.of(ds, 1, 4096), Numerics.of("bf16", low_precision_params=True)
    assert moe.worst_extra(ds, x, n, ACMode.full, 2, 64) > 0 == moe.worst_extra(ds, x, n, ACMode.full, 2, 1)


def test_step_time_counts_active_flops_and_the_all_to_alls():
    cfg = model("model=mixtral_8x7b", "train.seq_len=4096", "train.activation_checkpointing=full")
    m = cfg.model
    assert matmul_params(m) == matmul_params(m, active=True) < matmul_params(m, active=False)
    assert flops_per_token(m, 4096) == 6 * matmul_params(m, active=True) + 12 * 32 * 4096 * 4096
    hw = planner.Hardware(gpu_bytes=80 * 2**30, gpus_per_node=8, nnodes=2, tflops=planner.DEFAULT_TFLOPS)
    layout = dict(recipe="fsdp", dp=16, shard="zero3", fsdp=True)
    one, _ = cost.step_time(cfg, hw, footprint.Layout(**layout), ACMode.full, 1)
    eight, _ = cost.step_time(cfg, hw, footprint.Layout(**layout, ep=8), ACMode.full, 1)
    bw = cfg.plan.intra_node_gbps * 1e9
    # 32 MoE blocks: 2 all-to-alls forward, 2 backward, 2 in the recomputed forward
    a2a = 4096 * 2 * 4096 * 2 * (7 / 8) / bw * (6 * 32)
    assert moe.all_to_all_seconds(m, 4096, 2, 8, 32, bw) == pytest.approx(a2a)
    # FSDP gathers a rank's experts (forward, and again in backward: w bytes each) and reduce-scatters their
    # gradients (fp32) over the 2 ranks that share them, not all 8 experts over 16: ring (g-1)/g of each
    w = footprint.ds_weight_bytes(cfg)
    ring = lambda g: (g - 1) / g  # noqa: E731
    saved = (2 * w + 4) * (ring(16) - ring(2) / 8) * moe.expert_params(m) / (cfg.plan.inter_node_gbps * 1e9)
    # (cost.data_parallel_seconds splits each collective's bytes by the experts' share of the parameters; the
    # embedding, gathered once where a block is gathered twice, makes that share 0.06% off here)
    assert eight - one == pytest.approx(a2a - saved, rel=1e-3)
    across = moe.all_to_all_seconds(m, 4096, 2, 16, 32, cfg.plan.inter_node_gbps * 1e9)
    assert across > a2a


def test_make_plan_shows_counts_and_no_tp_or_pp_for_an_moe():
    out = here(
        "plan",
        "model=mixtral_8x7b",
        "cluster.nnodes=1",
        "cluster.gpus_per_node=8",
        "cluster.gpu_memory_gb=80",
        "train.seq_len=4096",
        "--json",
    )
    data = json.loads(out.stdout)
    assert data["params"]["total"] == 46_702_792_704 and data["params"]["active"] == 12_879_925_248
    assert data["params"]["blocks"] == [
        {"kind": "moe", "count": 32, "params": data["params"]["blocks"][0]["params"], "experts": 3 * 8 * 4096 * 14336}
    ]
    assert {r["layout"]["tp"] for r in data["rows"]} == {r["layout"]["pp"] for r in data["rows"]} == {1}
    text = here(
        "plan",
        "model=mixtral_8x7b",
        "cluster.nnodes=1",
        "cluster.gpus_per_node=8",
        "cluster.gpu_memory_gb=80",
        "train.seq_len=4096",
    ).stdout
    assert "46.70B parameters, 12.88B active per token" in text and "rows a rank's experts run" in text


def test_a_rehearsal_plans_each_ranks_experts():
    """moe_tiny under fsdp on 16 ranks (meta device, fake process group): 8 experts over 16
    ranks are cut on dimension 1 (whole rows would leave one expert on each of ranks 0-7 and
    none on 8-15), so every rank holds 8 of each expert's 128 rows; the plan of each rank
    within 2% of what its engine holds."""
    from launcher.planner import rehearse as R

    cfg = model("model=moe_tiny", "recipe=fsdp", "cluster.gpus_per_node=8", "cluster.nnodes=2")
    result = R.rehearse(cfg, 16, 8, None, ranks=[0, 7, 8, 15])
    experts = {r.rank: {s.name: s.local for s in r.shards}["layers.*.feed_forward.experts.w1"] for r in result.ranks}
    assert experts == {r: (8, 8, 128) for r in (0, 7, 8, 15)}
    assert all(abs(r.difference) <= R.TOLERANCE for r in result.ranks), [(r.rank, r.difference) for r in result.ranks]
    assert abs(result.ranks[0].total / result.ranks[-1].total - 1) < 0.01


def test_a_rehearsal_at_expert_parallel_plans_each_ranks_experts():
    """moe_tiny under fsdp ep=2 on 16 ranks: ep neighbours hold experts 0-3 and 4-7 as Shard(0)
    DTensors over ep, FSDP-sharded again over the 8 efsdp ranks holding the same ones (on
    dimension 1: 4 experts over 8 ranks); rank 1 (the other experts of rank 0's group) and
    the last rank rehearsed beside rank 0, each within 2% of its plan."""
    from launcher.planner import rehearse as R

    cfg = model("model=moe_tiny", "recipe=fsdp", "parallel.ep=2", "cluster.gpus_per_node=8", "cluster.nnodes=2")
    result = R.rehearse(cfg, 16, 8, None)
    assert [r.rank for r in result.ranks] == [0, 1, 15]
    w1 = {r.rank: {s.name: s for s in r.shards}["layers.*.feed_forward.experts.w1"] for r in result.ranks}
    assert all("@ep" in s.placements and "@efsdp" in s.placements for s in w1.values()), w1
    assert all(abs(r.difference) <= R.TOLERANCE for r in result.ranks), [(r.rank, r.difference) for r in result.ranks]
    assert result.ranks[0].total == result.ranks[1].total
    assert {r: (s.local, s.placements) for r, s in w1.items()} == {
        r: ((4, 16, 128), "S(1)@efsdp, S(0)@ep") for r in (0, 1, 15)
    }

"""The working set beyond model states at the sizes users run (issue 49 item 4): ZeRO-3's
gathered parameters with a 128k vocabulary's head, FSDP2's with and without resharding, the
step's collectives, host memory per node under offload. Plans only, no training: the numbers
in each docstring are derived from the engines' rules (launcher/planner/gathered.py,
collectives.py), not read off the code; tests/unit/test_gathered.py checks the replay of
DeepSpeed's rules against DeepSpeed's own count at a small size."""

from __future__ import annotations

import pytest

from launcher.launch import cli, compose
from launcher.planner import collectives, cost
from launcher.planner import gathered as G
from launcher.planner import plan as planner

H70 = 128256 * 8192  # Llama 3 70B's head (and embedding): 1,050,673,152 elements, over max_live's 1e9
B70 = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672  # a block: wq wo, wk wv (8 kv heads), w1 w3 w2
W70 = 8192 * 28672  # w1, w3 or w2: 234,881,024


def composed(*overrides: str):
    return cli.compose_config(["precision=bf16", *overrides])[0]


def test_llama3_70b_zero3_gathers_past_max_live():
    """DeepSpeed's defaults (max_live 1e9, prefetch one block as the launcher sets it, reuse
    distance 1e9). Forward: the last block (855,638,016) is gathered under the cap, and the
    prefetch that fills the cap takes the next parameter of the order, the head, whole:
    B + H = 1,906,311,168. Backward: at block 0's first module (w2) block 0 is gathered and
    the prefetch took the next parameter, the embedding (H), whole; w2's gradient is whole
    beside them: B + H + W = 2,141,192,192. The head's own backward holds H + its gradient
    H = 2,101,346,304, less. The old rule (a block and what the cap left of a
    prefetched one) was 1,000,000,000."""
    ws = G.of_config(composed("model=llama3_70b", "recipe=zero3"))
    assert (B70, H70) == (855_638_016, 1_050_673_152)
    assert ws.forward == B70 + H70 == 1_906_311_168
    assert ws.backward == B70 + H70 + W70 == 2_141_192_192
    assert ws.head == ws.head_grad == H70 and 2 * H70 < ws.backward


def test_llama3_405b_zero3_holds_the_head_and_its_gradient():
    """405B (dim 16384): H = 128256 x 16384 = 2,101,346,304 alone exceeds max_live, so while
    the head is gathered nothing is prefetched. Forward: at the last block's w2 (16384 x
    53248 = 872,415,232) the cap leaves 127.6M to prefetch: the head is taken whole,
    872,415,232 + 2,101,346,304 = 2,973,761,536. Backward: the head gathered and its whole
    gradient, 2H = 4,202,692,608, the step's largest."""
    ws = G.of_config(composed("model=llama3_405b", "recipe=zero3"))
    assert ws.forward == 16384 * 53248 + 128256 * 16384 == 2_973_761_536
    assert ws.backward == 2 * 128256 * 16384 == 4_202_692_608
    assert "head" in ws.at_peak and "backward" in ws.at_peak


def test_max_live_and_prefetch_move_the_working_set():
    """stage3_max_live_parameters above H + B (3e9) lets the prefetch reach a whole block
    beside the head; stage3_prefetch_bucket_size=1 takes one parameter at a time, but
    the next parameter is still taken whole: at the last block (its forward), the head."""
    base = G.of_config(composed("model=llama3_70b", "recipe=zero3"))
    wide = G.of_config(composed("model=llama3_70b", "recipe=zero3", "recipe.zero.max_live_parameters=3000000000"))
    one = G.of_config(composed("model=llama3_70b", "recipe=zero3", "recipe.zero.prefetch_bucket_size=1"))
    assert wide.peak > base.peak >= one.peak
    assert one.forward >= H70


def test_gpt_7b_zero3_sits_at_max_live():
    """gpt_7b's parameters are small (the head 32000 x 4096 = 131,072,000, a block 202,375,168):
    every hook's prefetch fills the gathered set up to stage3_max_live_parameters, so it
    sits at about 1e9 elements (five blocks), not two blocks, whatever the reuse window
    (max_reuse_distance=0 releases every module after use: the same peak); max_live=5e8
    brings it down by about 5e8."""
    ws = G.of_config(composed("model=gpt_7b", "recipe=zero3"))
    short = G.of_config(composed("model=gpt_7b", "recipe=zero3", "recipe.zero.max_reuse_distance=0"))
    half = G.of_config(composed("model=gpt_7b", "recipe=zero3", "recipe.zero.max_live_parameters=500000000"))
    assert 1_000_000_000 < ws.peak < 1_000_000_000 + 131_072_000 + 2 * 45_088_768 + 45_088_768
    assert short.peak == ws.peak
    assert 0.4e9 < ws.peak - half.peak < 0.6e9


@pytest.mark.parametrize("reshard", [True, False])
def test_llama3_70b_fsdp_working_set(reshard):
    """FSDP2 on 8 ranks: the root (embedding + head, 2H) stays gathered; forward adds the block
    that computes and the next one's all-gather (2B): 2H + 2B = 3,812,622,336. Backward adds
    the head's whole gradient (H), held to the root's reduce-scatter at backward's end, and
    with reshard_after_forward=false every block (80B) instead of two."""
    cfg = composed("model=llama3_70b", "recipe=fsdp", f"recipe.fsdp.reshard_after_forward={str(reshard).lower()}")
    ws = G.of_layout(cfg, planner.layout_for(cfg, 8))
    assert ws["forward"] == 2 * H70 + 2 * B70 == 3_812_622_336
    assert ws["backward"] == 3 * H70 + (2 if reshard else 80) * B70


def test_collectives_per_step():
    """Llama 3 70B (Ψ = 70,553,706,496) on 8 ranks, one micro-batch. FSDP2 gathers 81 units
    in forward and 80 blocks again in backward (161 all-gathers) and reduce-scatters 81 units
    of fp32 gradients (4Ψ bytes); without resharding the backward gathers nothing. ZeRO-3
    gathers in forward at least every parameter once (2Ψ bytes), reduce-scatters 2Ψ bytes in
    ceil(Ψ / dim²) = 1052 buckets; zero2 all-reduces as many buckets (DeepSpeed 0.19's
    use_multi_rank_bucket_allreduce: tests/e2e/test_zero.py measures it) and all-gathers the
    updated weights in one call per parameter group, two (allgather_bucket_size changes
    nothing); with use_multi_rank_bucket_allreduce off, a reduce per rank's slice."""
    psi = 70_553_706_496
    cfg = composed("model=llama3_70b", "recipe=fsdp")
    c = collectives.per_step(cfg, planner.layout_for(cfg, 8))
    assert c["all_gather"]["count"] == 161 and c["reduce_scatter"] == {"count": 81, "bytes": 4 * psi}
    no = composed("model=llama3_70b", "recipe=fsdp", "recipe.fsdp.reshard_after_forward=false")
    assert collectives.per_step(no, planner.layout_for(no, 8))["all_gather"] == {"count": 81, "bytes": 2 * psi}
    z3 = composed("model=llama3_70b", "recipe=zero3")
    c3 = collectives.per_step(z3, planner.layout_for(z3, 8))
    assert (
        c3["reduce_scatter"] == {"count": -(-psi // 8192**2), "bytes": 2 * psi}
        and c3["reduce_scatter"]["count"] == 1052
    )
    assert c3["all_gather"]["bytes"] > 2 * psi  # forward, and backward's re-gathers
    z2 = composed("model=llama3_70b", "recipe=zero2")
    c2 = collectives.per_step(z2, planner.layout_for(z2, 8))
    assert c2 == {"all_reduce": {"count": 1052, "bytes": 2 * psi}, "all_gather": {"count": 2, "bytes": 2 * psi}}
    small = composed("model=llama3_70b", "recipe=zero2", "recipe.zero.allgather_bucket_size=1000000")
    assert collectives.per_step(small, planner.layout_for(small, 8)) == c2
    off = composed(
        "model=llama3_70b", "recipe=zero2", "+recipe.zero.extra.zero_optimization.use_multi_rank_bucket_allreduce=false"
    )
    assert collectives.per_step(off, planner.layout_for(off, 8))["reduce_scatter"] == {
        "count": 1052 + 7,
        "bytes": 2 * psi,
    }


def test_step_time_prices_each_counted_collective():
    """The step time's data-parallel term is the counted collectives: llama3_70b zero2 on 8
    GPUs of one node, its ring share (7/8) of every collective's bytes at plan.intra_node_gbps
    plus plan.collective_latency_us a launch. Smaller reduce buckets cost only their extra
    launches; accumulation repeats zero2's all-reduces, not its all-gathers; fp32 moves
    twice the bytes of bf16."""

    def seconds(*extra: str) -> tuple[float, dict]:
        cfg = composed("model=llama3_70b", "recipe=zero2", *extra)
        layout = planner.layout_for(cfg, 8)
        return cost.data_parallel_seconds(cfg, layout, cfg.plan.intra_node_gbps * 1e9), collectives.per_step(
            cfg, layout
        )

    base, c = seconds()
    bw, latency = 200e9, 20e-6
    moved = 7 / 8 * (c["all_gather"]["bytes"] + 2 * c["all_reduce"]["bytes"])  # an all-reduce: twice
    assert base == pytest.approx(moved / bw + (c["all_gather"]["count"] + c["all_reduce"]["count"]) * latency)
    small, cs = seconds(f"recipe.zero.reduce_bucket_size={8192**2 // 4}")
    assert cs["all_reduce"]["count"] == -(-70_553_706_496 // (8192**2 // 4)) == 4206
    assert small - base == pytest.approx((cs["all_reduce"]["count"] - c["all_reduce"]["count"]) * latency)
    accum, ca = seconds("train.grad_accum=4")
    assert ca["all_reduce"]["bytes"] == 4 * c["all_reduce"]["bytes"]
    assert ca["all_gather"] == c["all_gather"] and accum > 2.4 * base
    fp32, _ = seconds("precision=fp32")
    assert fp32 > 1.9 * base


@pytest.mark.parametrize("recipe,per_rank", [("zero3_offload", 20), ("zero2_offload", 18)])
def test_offload_over_host_memory_does_not_fit(recipe, per_rank):
    """Host memory per node, one node of 8 ranks (N = 8): zero3_offload keeps the 16-bit
    weight shard (2Ψ/N), the 16-bit and fp32 gradient shards (6Ψ/N) and Adam's fp32 master
    and moments (12Ψ/N) in host memory: 20Ψ/N a rank, 20Ψ = 1,411 GB a node. zero2_offload:
    the pinned upload buffer (2Ψ/N), the fp32 gradient (4Ψ/N), 12Ψ/N of Adam, and a copy
    buffer of the largest parameter (2H): 18Ψ + 8 x 2H a node. Both over 1000 GiB: the rows
    do not fit, and say so."""
    psi = 70_553_706_496
    cfg = composed("model=llama3_70b", f"recipe={recipe}", "plan.host_memory_gb=1000")
    hw = planner.Hardware(
        gpu_bytes=141 * 2**30, gpus_per_node=8, nnodes=1, tflops=planner.DEFAULT_TFLOPS, host_bytes=1000 * 2**30
    )
    rows = planner.plan(cfg, hw, compose.recipe_configs({recipe}))
    expected = per_rank * psi + (0 if recipe == "zero3_offload" else 8 * 2 * H70)
    for r in rows:
        assert abs(planner.host_per_node(r, hw) / expected - 1) < 0.01, (r.layout.label, planner.host_per_node(r, hw))
        assert not r.fits and "host memory" in r.why_not and "plan.host_memory_gb=1000" in r.why_not


def test_fsdp_without_resharding_charges_every_block():
    """recipe.fsdp.reshard_after_forward=false: every block (80 x 855,638,016 elements, bf16)
    stays gathered to its backward; the plan's temporaries hold them instead of two blocks:
    2 x (80 - 2) x B = 133,479,530,496 bytes more (llama3_70b, 64 GPUs, full recomputation)."""
    from launcher.config import ACMode

    rows = []
    for reshard in ("true", "false"):
        cfg = composed("model=llama3_70b", "recipe=fsdp", f"recipe.fsdp.reshard_after_forward={reshard}")
        rows.append(planner.memory_row(cfg, planner.layout_for(cfg, 64), ACMode.full, 1))
    assert rows[1].temp - rows[0].temp == 2 * (80 - 2) * B70 == 133_479_530_496

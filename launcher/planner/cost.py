"""The planner's relative step time of a layout: compute at plan.mfu of the GPU's peak,
the collectives at the configured bandwidths, offload's copies (launcher/planner/plan.py
ranks the layouts that fit by it). Communication is assumed not to overlap compute, so the
figure is pessimistic for every layout alike."""

from __future__ import annotations

from launcher.config import ACMode, Config, block_matmul_params, ffn_dim, head_dim, matmul_params
from launcher.models.gpt import flops_per_token
from launcher.planner import collectives, lora, moe
from launcher.planner import memory as M
from launcher.planner.footprint import Layout, activations, numerics, param_share

OP_RECOMPUTE = 0.1
"""activation_checkpointing=op: the elementwise work (norms, SiLU, products, casts, rotary)
a block recomputes, as a share of its forward's time. Few FLOPs but memory-bound; an
estimate (10%), not yet measured on a GPU. The three matmuls it makes again (wk, wo, w3)
are counted by their FLOPs on top (M.op_recomputed_params)."""


def step_time(cfg: Config, hw, layout: Layout, ac: ACMode, b: int) -> tuple[float, int]:
    """Seconds per optimizer step and tokens per step, for the global batch this
    micro-batch gives with the configured accumulation."""
    p = cfg.plan
    m, s = cfg.model, cfg.train.seq_len
    accum = cfg.train.grad_accum
    tokens = b * accum * layout.dp * s
    # A recomputed block runs its forward again (2 of 6 FLOPs a parameter and token); at op
    # level its elementwise work (OP_RECOMPUTE) and three of its seven matmuls.
    share = (OP_RECOMPUTE + op_recomputed_params(m) / block_matmul_params(m)) if ac == ACMode.op else 1.0
    recompute = 1 + (2 / 6) * share * M.recomputed(m.n_layers, ac, cfg.train.ac_every) / m.n_layers
    # model.lora: a frozen weight's own gradient is never computed (4 of its 6 FLOPs a token remain)
    per_token = flops_per_token(m, s) - (2 * matmul_params(m) if lora.enabled(m) else 0)
    flops = tokens * per_token * recompute / (layout.dp * layout.cp * layout.tp * layout.pp)
    compute = flops / (hw.tflops * 1e12 * p.mfu)
    if layout.pp > 1:  # the pipeline bubble: (pp - 1) idle micro-batch slots per step
        compute *= (accum + layout.pp - 1) / accum

    def bandwidth(group: int, spans_nodes: bool) -> float:
        return (p.inter_node_gbps if spans_nodes else p.intra_node_gbps) * 1e9

    dp_spans = layout.dp * layout.cp * layout.tp * layout.pp > hw.gpus_per_node
    comm = data_parallel_seconds(cfg, layout, bandwidth(layout.dp, dp_spans))
    if layout.cp > 1:  # 4 all-to-alls (q, k, v, out) per layer forward and 4 backward, (cp-1)/cp of each moves
        act = b * layout.seq(s) * m.dim * numerics(cfg.precision.name, layout).compute
        comm += accum * m.n_layers / layout.pp * 8 * ((layout.cp - 1) / layout.cp) * act / bandwidth(layout.cp, False)
    if layout.tp > 1:  # 4 all-reduces of b*s*h activations per layer per micro-batch
        act = b * layout.seq(s) * m.dim * numerics(cfg.precision.name, layout).compute
        comm += (
            accum * m.n_layers / layout.pp * 4 * (2 * (layout.tp - 1) / layout.tp) * act / bandwidth(layout.tp, False)
        )
    if layout.ep > 1:  # model.moe: dispatch and combine, forward, backward and recomputation
        comm += accum * moe.all_to_all_seconds(
            m,
            b * layout.seq(s),
            numerics(cfg.precision.name, layout).compute,
            layout.ep,
            M.recomputed(m.n_layers, ac, cfg.train.ac_every),
            bandwidth(layout.ep, layout.ep > hw.gpus_per_node),
        )
    if layout.pp > 1:  # activations forward and gradients back across each boundary
        comm += accum * 2 * b * s * m.dim * numerics(cfg.precision.name, layout).compute / bandwidth(2, dp_spans)
    offload = 0.0
    P = param_share(cfg, layout)
    T = lora.counts(m).trainable if lora.enabled(m) else P  # what has gradients to reduce and states to update
    if layout.offload_optim:
        shard = T / layout.dp
        offload += (4 * shard + 2 * shard) / (p.pcie_gbps * 1e9) + shard / p.cpu_adam_params_per_s
    if layout.offload_params:
        offload += 2 * 2 * (P / layout.dp) / (p.pcie_gbps * 1e9)
    if cfg.train.activation_offload:  # each micro-batch's activations out in forward and back in backward
        offload += accum * 2 * activations(cfg, layout, ac, b, where="host") / (p.pcie_gbps * 1e9)
    return compute + comm + offload, tokens


RING = {
    "all_gather": lambda g: (g - 1) / g,
    "reduce_scatter": lambda g: (g - 1) / g,
    "all_reduce": lambda g: 2 * (g - 1) / g,
}
"""The share of a collective's whole tensor each rank sends over its link in a ring of g ranks."""


def data_parallel_seconds(cfg: Config, layout: Layout, bytes_per_s: float) -> float:
    """The step's data-parallel collectives as the engines launch them (collectives.per_step:
    every micro-batch's reduce-scatters and ZeRO-3/FSDP re-gathers, each in its own dtype and
    buckets), each moving its ring share at `bytes_per_s` plus plan.collective_latency_us a
    message. model.moe's experts go over the dp x cp / ep ranks that hold the same ones,
    their share of each collective's bytes taken as their share of the rank's parameters
    (a block is gathered twice, the embedding once: Mixtral-8x7B's time is 0.06% off).
    A pipeline (per_step has no count for it yet) keeps the volume estimate: gradients
    all-reduced (fp32) or reduce-scattered and gathered (ZeRO, 16-bit) once a step."""
    m, group = cfg.model, layout.dp * layout.cp  # context-parallel ranks average gradients too
    P = param_share(cfg, layout)
    experts = moe.expert_params(m) // layout.ep / P if moe.enabled(m) else 0.0  # the experts' share
    latency = cfg.plan.collective_latency_us * 1e-6
    if layout.pp > 1:
        T = lora.counts(m).trainable if lora.enabled(m) else P
        nbytes = {"none": 4 * T, "zero3": 2 * P + T}.get(layout.shard, 2 * T)  # fp32 all-reduce; 16-bit
        return RING["all_reduce"](group) * nbytes / bytes_per_s if group > 1 else 0.0
    seconds = 0.0
    for kind, c in collectives.per_step(cfg, layout).items():
        ring = (1 - experts) * RING[kind](group) + experts * RING[kind](max(1, group // layout.ep))
        seconds += ring * c["bytes"] / bytes_per_s + c["count"] * latency
    return seconds


def op_recomputed_params(m) -> int:
    """The matmul weights whose products op-level recomputation makes again (wk, wo, w3:
    launcher/models/gpt.py::keep_matmuls)."""
    kv = (m.n_kv_heads or m.n_heads) * head_dim(m)
    return m.dim * kv + m.dim * m.n_heads * head_dim(m) + m.dim * ffn_dim(m)

"""A mixture of experts in the plan (model.moe; docs/memory.md, "Mixture of experts").

Parameters. An MoE block holds attention, a router (E x dim), E routed SwiGLU experts
(3 x dim x expert_dim each) and the shared expert; the first model.moe.first_dense blocks
keep a dense SwiGLU. Memory holds every expert (`total`), a token runs its top k
(`active`: the FLOPs, launcher.config.num_params(m, active=True)).

Where the states live under parallel.ep (torchtitan's layout): the dense weights (all but
the routed experts) over the dp x cp data-parallel ranks as without ep; the routed experts
E/ep to a rank of each ep group, and those over the n/ep ranks that hold the same experts
(FSDP shards them there, ddp replicates them). FSDP2 cuts each stacked expert weight on its
first dimension, E/ep, in whole experts while they are at least as many as those ranks;
with fewer (Mixtral's 8 on 16 ranks) on its second, so every rank holds its share of each
expert (launcher/parallel/experts.py::expert_placement; torchtitan's rule). The ZeRO
recipes flatten everything (ep = 1): the dense formulas hold.

Dispatch. The rows (token, expert pairs) a rank's experts run on a micro-batch of N tokens
a rank: N k when the router balances; with moe.capacity_factor cf at most E x ceil(cf N k / E)
(each expert its capacity, from each of the ep ranks its tokens come from); without one, at
the worst imbalance the router allows, every token of the ep group's ranks on this rank's
experts: ep N min(k, E/ep) rows (top-k picks k distinct experts, at most E/ep of them here).
At ep = 1 the rows are N k however the router chooses: only under ep does imbalance move
memory. The plan holds the balanced (or capacity-bounded) rows; `worst_extra` says what the
worst case adds (torchtitan and Megatron's drop-less dispatch size their buffers by the
actual counts alike: only a capacity factor bounds them).
"""

from __future__ import annotations

import math

from launcher.config import ACMode, ModelConfig, block_matmul_params, expert_dim, is_moe_block, shared_dim
from launcher.planner import memory as M


def enabled(m: ModelConfig) -> bool:
    return m.moe.experts > 0


def expert_params(m: ModelConfig) -> int:
    """The routed experts' parameters, every MoE block."""
    return M.ParamCounts.of(m).expert_total


def rank_params(m: ModelConfig, ep: int) -> int:
    """Parameters a rank holds before data-parallel sharding: the dense ones and E/ep experts."""
    c = M.ParamCounts.of(m)
    return c.total - c.expert_total + c.expert_total // ep


def outside_ddp(m: ModelConfig, ep: int) -> int:
    """Parameters a ddp rank keeps out of DDP's gradient buckets: under ep its E/ep experts
    (averaged over the ranks holding the same ones after backward: launcher/parallel/experts.py)."""
    return expert_params(m) // ep if ep > 1 and enabled(m) else 0


def fsdp_elements(m: ModelConfig, n: int, ep: int, index: int = 0) -> int:
    """Elements FSDP leaves on a rank of n = dp x cp (`index`: its place among them; 0, the
    rank holding the most, by default): the dense parameters' n-th, and of the routed experts
    the rank's piece among the n/ep ranks that hold the same E/ep experts, at place index // ep
    (launcher/parallel/experts.py::split_mesh). Each piece is torch.chunk's, as FSDP2 cuts:
    on dimension 0 (whole experts) while the experts are at least as many as those ranks,
    else on dimension 1 (w1, w3: the expert width; w2: dim), as expert_placement picks."""
    c = M.ParamCounts.of(m)
    dense = c.total - c.expert_total
    if not c.expert_total:
        return dense // n
    local, ranks, j = m.moe.experts // ep, max(1, n // ep), index // ep
    if local >= ranks:
        return dense // n + c.expert_total // ep * _chunk(local, ranks, j) // local
    blocks = sum(is_moe_block(m, i) for i in range(m.n_layers))
    h, f = m.dim, expert_dim(m)
    return dense // n + blocks * local * (2 * _chunk(f, ranks, j) * h + _chunk(h, ranks, j) * f)


def _chunk(size: int, ranks: int, j: int) -> int:
    """Rows of `size` torch.chunk gives piece j of `ranks` (ceil-sized; the last ones may hold none)."""
    step = -(-size // ranks)
    return max(0, min(size, (j + 1) * step) - j * step)


def rows(m: ModelConfig, tokens: int, ep: int = 1, worst: bool = False) -> int:
    """Rows a rank's experts run for `tokens` tokens a rank (the module docstring's bounds)."""
    e = m.moe
    balanced = tokens * e.top_k
    if e.capacity_factor is not None:
        return min(
            ep * tokens * min(e.top_k, e.experts // ep), e.experts * math.ceil(e.capacity_factor * balanced / e.experts)
        )
    return ep * tokens * min(e.top_k, e.experts // ep) if worst else balanced


def ffn_bytes(m: ModelConfig, x: M.Shape, n: M.Numerics, R: int, ep: int = 1) -> int:
    """What an MoE feed-forward saves for backward (N = b s tokens, R rows this rank's experts
    run, S = rows(N) rows its tokens send (R at ep=1), h = dim, f the expert width, c / r
    compute / residual bytes; launcher/models/moe.py, experts.py):
      inputs   the norm's output and the gathered rows (r N h + r R h); autocast (bf16 on a
               GPU: grouped matmuls) the router's and the rows' casts (c N h + c R h), and the
               shared expert's own two (2 c N h)
      router   fp32 scores (4 N E: softmax's or sigmoid's output, topk and gather use them),
               the int64 top-k indices (8 N k), renormalization's weights and sums (4 N k + 4 N),
               balance=aux_loss's expert fractions (4 E; sigmoid: its score sums, 4 N)
      experts  the rows' token and pair indices (16 S), w1 out, SiLU out, w3 out, product
               (4 c R f), the experts' output and its weights (r S h + r S: in the residual's
               dtype), the weighted rows index_add_ sums into their tokens (r S h: it keeps
               its source); under ep also the received rows' order (8 R) and the outputs put
               back in it (r R h: index_copy keeps its source), the all-to-alls save nothing
      shared   4 c N f_s (f_s = moe.shared_dim), as a dense SwiGLU (moe.shared_gate's N-wide
               logits and sigmoid are not counted)
      autocast the experts' SwiGLU casts the stacked weights every forward and keeps the
               copies for backward (experts.py::_SwiGLU): 3 c (E/ep) h f, beside the weight copies
    Checked to the byte against autograd at ep=1 in fp32 and bf16 parameters
    (tests/unit/test_moe_plan.py); CPU ranks cannot run an MoE under autocast (the experts'
    bf16 rows into fp32 tokens), so that regime follows the GPU's grouped path, unmeasured
    here, as are the ep terms."""
    e, N, h, c, r = m.moe, x.b * x.s, x.h, n.compute, n.residual
    f, shared = expert_dim(m), shared_dim(m)
    if n.autocast:
        inputs = c * N * h + c * R * h + (2 * c * N * h if shared else 0)
    else:
        inputs = r * N * h + r * R * h
    renorm = e.norm_topk and (e.top_k > 1 or e.score.value == "sigmoid")
    router = 4 * N * e.experts + 8 * N * e.top_k + ((4 * N * e.top_k + 4 * N) if renorm else 0)
    if e.balance.value == "aux_loss":
        router += 4 * e.experts + (4 * N if e.score.value == "sigmoid" else 0)
    S = rows(m, N)
    experts = 16 * S + 4 * c * R * f + 2 * r * S * h + r * S + ((8 * R + r * R * h) if ep > 1 else 0)
    casts = 3 * c * (e.experts // ep) * h * f if n.autocast else 0
    return inputs + router + experts + 4 * c * N * shared + casts


def dense_ffn_bytes(x: M.Shape, n: M.Numerics) -> int:
    """What memory.block_activations counts for a dense feed-forward (its inputs and SwiGLU)."""
    return M._linear_inputs(x, n, 2) + 4 * n.compute * x.b * x.s * x.f


def kept_blocks(m: ModelConfig, ac: ACMode, every: int) -> list[int]:
    """The blocks that keep their activations (memory.recomputed's rule, block by block)."""
    if ac in (ACMode.full, ACMode.op):
        return []
    return [i for i in range(m.n_layers) if not (ac == ACMode.selective and i % every == 0)]


def rank_block_params(m: ModelConfig, i: int, ep: int) -> int:
    """Block i's matmul weights on a rank: its routed experts only E/ep of E."""
    local = block_matmul_params(m, i)
    if is_moe_block(m, i):
        local -= (m.moe.experts - m.moe.experts // ep) * 3 * m.dim * expert_dim(m)
    return local


def activation_delta(m: ModelConfig, x: M.Shape, n: M.Numerics, ac: ACMode, every: int, ep: int = 1) -> int:
    """What the MoE blocks save beyond memory.activation_bytes's dense count: each kept MoE
    block's feed-forward in place of a dense one, and autocast's weight copies of the blocks
    as they are (memory.weight_copies counts block 0's weights for each). Nothing for ZeRO-3's
    gathered experts: the experts' SwiGLU saves the stacked weights themselves, not slices of
    them (launcher/models/experts.py::_SwiGLU), so DeepSpeed releases them after forward as a
    dense layer's (measured: tests/e2e/test_plan_runs.py::test_the_plan_holds_for_an_moe)."""
    if not enabled(m):
        return 0
    R = rows(m, x.b * x.s, ep)
    delta = 0
    for i in kept_blocks(m, ac, every):
        if is_moe_block(m, i):
            delta += ffn_bytes(m, x, n, R, ep) - dense_ffn_bytes(x, n)
        if n.autocast:
            delta += n.compute * (rank_block_params(m, i, ep) - x.block_params)
    return delta


def recompute_delta(m: ModelConfig, x: M.Shape, n: M.Numerics, ep: int = 1) -> int:
    """One block recomputed at a time: an MoE block's activations beyond a dense one's."""
    if not enabled(m):
        return 0
    return max(0, ffn_bytes(m, x, n, rows(m, x.b * x.s, ep), ep) - dense_ffn_bytes(x, n))


def largest_block_delta(m: ModelConfig, ep: int = 1) -> int:
    """Matmul weights of the largest block a rank holds beyond block 0's (ZeRO-3's gathered layers)."""
    if not enabled(m):
        return 0
    return max(rank_block_params(m, i, ep) for i in range(m.n_layers)) - block_matmul_params(m)


def worst_extra(m: ModelConfig, x: M.Shape, n: M.Numerics, ac: ACMode, every: int, ep: int) -> int:
    """Bytes one rank adds at the worst imbalance the router allows (no capacity factor, ep > 1)
    over the plan's balanced rows: in every kept MoE block, and in the block being recomputed."""
    if not enabled(m) or ep == 1 or m.moe.capacity_factor is not None:
        return 0
    N = x.b * x.s
    more = ffn_bytes(m, x, n, rows(m, N, ep, worst=True), ep) - ffn_bytes(m, x, n, rows(m, N, ep), ep)
    blocks = sum(is_moe_block(m, i) for i in kept_blocks(m, ac, every))
    return more * (blocks + (1 if ac != ACMode.none else 0))


# ----------------------------------------------------------------------------- step time
def all_to_all_seconds(
    m: ModelConfig, tokens: int, compute_bytes: int, ep: int, recomputed: int, bandwidth: float
) -> float:
    """Expert parallel's all-to-alls for one micro-batch of `tokens` tokens a rank: per MoE
    block two forward (dispatch, combine) and two backward, and two more in each recomputed
    MoE block; each moves tokens x k x dim x bytes, (ep-1)/ep of it off the rank."""
    if not enabled(m) or ep == 1:
        return 0.0
    blocks = sum(is_moe_block(m, i) for i in range(m.n_layers))
    per = tokens * m.moe.top_k * m.dim * compute_bytes * (ep - 1) / ep / bandwidth
    return per * (4 * blocks + 2 * min(recomputed, blocks))


# ----------------------------------------------------------------------------- layouts
def ep_degrees(cfg, world: int, gpus_per_node: int, can: bool) -> tuple[int, ...]:
    """The expert-parallel degrees `make plan` compares for a recipe: 1 where the recipe has
    no expert parallel (or the model no experts); else the configured parallel.ep when > 1,
    or 1 and the largest ep that divides the experts and the world within a node (its
    all-to-alls on the node's links, as torchtitan and DeepSeek place them first)."""
    m, asked = cfg.model, cfg.parallel.ep
    if not (can and enabled(m)):
        return (1,)
    if asked > 1:
        return (asked,) if m.moe.experts % asked == 0 and world % asked == 0 else ()
    best = max(d for d in range(1, min(gpus_per_node, m.moe.experts) + 1) if m.moe.experts % d == 0 and world % d == 0)
    return (1, best) if best > 1 else (1,)


def dispatch_line(m: ModelConfig, seq_len: int, rows_: list, best=None) -> str:
    """`make plan`'s line on the dispatch, for the recommended row (else the first): the rows a
    rank's experts run per micro-batch, balanced, at the capacity, at the worst imbalance."""
    row, e = best or rows_[0], m.moe
    ep, N = row.layout.ep, row.micro_batch * row.layout.seq(seq_len)
    cap = (
        f"; capacity_factor {e.capacity_factor:g} bounds them at {rows(m, N, ep):,}"
        if e.capacity_factor is not None
        else f"; at the worst imbalance the router allows {rows(m, N, ep, worst=True):,}"
        + (
            f" (+{row.dispatch_worst / 2**30:.2f} GiB a rank, not in total: model.moe.capacity_factor bounds it)"
            if ep > 1
            else " (the same bytes at ep=1)"
        )
    )
    return (
        f"MoE: {e.experts} experts, top-{e.top_k}; on {row.layout.label}, micro-batch {row.micro_batch}: "
        f"{N * e.top_k:,} rows a rank's experts run when balanced ({N:,} tokens x {e.top_k}){cap}"
    )

"""The routed experts of an MoE block: E SwiGLUs held as three stacked weights, and the
token dispatch (launcher/models/moe.py routes; this computes).

    w1, w3: (E, hidden, dim)   w2: (E, dim, hidden)

One call takes the block's tokens x (N, dim) with each token's k experts and weights, and
returns sum_j weight_j * expert_j(x) per token. The N x k (token, expert) pairs are sorted by
expert, so each expert's rows are contiguous; each group runs through its expert (a grouped
matrix multiplication on CUDA where torch has one, `torch._grouped_mm`; a loop over the
experts elsewhere: the same arithmetic), then the rows are weighted and summed back into
their tokens. With moe.capacity_factor an expert takes at most ceil(factor x N x k / E) rows,
the first ones in token order; the rest are dropped (their contribution is zero) and counted.

Expert parallel (parallel.ep > 1; the recipe sets `ep_group`, launcher/parallel/experts.py):
this rank holds experts [r E/ep, (r+1) E/ep) of its ep group. The capacity is applied
where the tokens are, before dispatch (the same rows drop as at ep=1, counted on their
rank); one all-to-all of the rows per expert tells each rank what it receives, the rows
travel to their experts' ranks and back by two all-to-alls (2 x N x k x dim elements a
block, each way; the same again in backward), and the sum over a token's experts is made
where the token lives.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class Experts(nn.Module):
    def __init__(self, experts: int, dim: int, hidden: int, capacity_factor: float | None = None):
        super().__init__()
        self.num_experts = experts
        self.capacity_factor = capacity_factor
        self.w1 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.ep_group = None
        """parallel.ep > 1: the process group over which the experts are split (rank r of it
        holds experts [r E/ep, (r+1) E/ep)); None: every expert is here."""
        self.held_boxes: dict[str, tuple[tuple[int, ...], tuple[tuple[int, int], ...]]] = {}
        """Plain local shards (ddp under ep): leaf name -> (full shape, this rank's box), for the
        layout-independent init (launcher/models/init.py). DTensor shards report their own."""

    def forward(
        self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(out (N, dim), rows dropped or None without a capacity) for x (N, dim), indices and
        weights (N, k)."""
        rows, order, counts = sort_by_expert(indices, self.num_experts)
        dropped = None
        if self.capacity_factor is not None:
            keep = within_capacity(
                counts, capacity(x.size(0) * indices.size(1), self.num_experts, self.capacity_factor)
            )
            dropped = (~keep).sum().float()
            order, rows = order[keep], rows[keep]
            counts = torch.bincount(indices.flatten()[order], minlength=self.num_experts)
        w1, w2, w3 = (_local(w) for w in (self.w1, self.w2, self.w3))
        if self.ep_group is None:
            y = expert_mlp(x[rows], w1, w2, w3, counts)
        else:
            y = dispatched_mlp(x[rows], counts, w1, w2, w3, self.ep_group)
        y = y * weights.flatten()[order].unsqueeze(-1).to(y.dtype)
        # autocast: y in bf16, x (ddp's fp32 residual stream) may not be; summed in x's dtype
        return torch.zeros_like(x).index_add_(0, rows, y.to(x.dtype)), dropped


def _local(w: torch.Tensor) -> torch.Tensor:
    """A DTensor's local experts (FSDP under ep: Shard(0) over the ep ranks), with autograd."""
    return w.to_local() if hasattr(w, "to_local") else w


def dispatched_mlp(x: torch.Tensor, counts: torch.Tensor, w1, w2, w3, group) -> torch.Tensor:
    """Rows x (sum(counts), dim) grouped by global expert (counts (E,)) through their experts,
    which lie on the ranks of `group` (E/ep each, these ranks' w1, w2, w3): rows out in the
    order they came."""
    ep = dist.get_world_size(group)
    send = counts.view(ep, -1)  # (to rank, its local expert)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send.contiguous(), group=group)  # (from rank, my local expert)
    sizes = torch.stack([send.sum(1), recv.sum(1)]).tolist()  # one host synchronisation
    rows = _AllToAll.apply(x, sizes[1], sizes[0], group)  # by source rank, then by expert
    perm = _expert_major(recv)
    y = expert_mlp(rows[perm], w1, w2, w3, recv.sum(0))
    back = torch.empty_like(y).index_copy(0, perm, y)  # source-rank order again
    return _AllToAll.apply(back, sizes[0], sizes[1], group)


def _expert_major(recv: torch.Tensor) -> torch.Tensor:
    """For rows received as blocks (source rank, local expert) in row-major order with
    `recv` rows each: the row indices that put them expert-major (source rank within)."""
    flat = recv.flatten()
    starts = (torch.cumsum(flat, 0) - flat).view_as(recv).t().flatten()
    sizes = recv.t().flatten()
    offsets = torch.arange(int(sizes.sum()), device=recv.device) - torch.repeat_interleave(
        torch.cumsum(sizes, 0) - sizes, sizes
    )
    return torch.repeat_interleave(starts, sizes) + offsets


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with autograd (gloo and NCCL): rows [sum(inputs)] split by `inputs`
    to the group's ranks, rows [sum(outputs)] received; backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x, outputs: list[int], inputs: list[int], group):
        ctx.sizes, ctx.group = (outputs, inputs), group
        out = x.new_empty((sum(outputs), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), outputs, inputs, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        outputs, inputs = ctx.sizes
        back = grad.new_empty((sum(inputs), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), inputs, outputs, group=ctx.group)
        return back, None, None, None


def sort_by_expert(indices: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the token of each (token, expert) pair in expert order, the pairs' order in the
    flattened N x k indices, rows per expert (E,))."""
    flat = indices.flatten()
    order = torch.argsort(flat, stable=True)  # within an expert, token order: capacity keeps the first
    return order // indices.size(1), order, torch.bincount(flat, minlength=experts)


def capacity(pairs: int, experts: int, factor: float) -> int:
    """Rows an expert takes: factor x its fair share of the N x k pairs, rounded up."""
    return max(1, math.ceil(factor * pairs / experts))


def within_capacity(counts: torch.Tensor, cap: int) -> torch.Tensor:
    """For the pairs in expert order: whether each is among its expert's first `cap`."""
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(int(counts.sum()), device=counts.device) - torch.repeat_interleave(starts, counts)
    return position < cap


def expert_mlp(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """Rows x (sum(counts), dim), grouped by expert (counts[e] rows for expert e), through their
    expert's SwiGLU: w2 (silu(w1 x) * w3 x). Under autocast, in its dtype (the grouped path:
    bf16 matmuls, out in x's dtype)."""
    if (
        x.is_cuda
        and hasattr(torch, "_grouped_mm")
        and x.size(0) > 0
        and torch.is_autocast_enabled("cuda")
        and torch.get_autocast_dtype("cuda") == torch.bfloat16
    ):  # fp32 runs keep fp32 matmuls
        return _SwiGLU.apply(x, w1, w2, w3, counts, True, torch.bfloat16).to(x.dtype)
    dev = x.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    return _SwiGLU.apply(x, w1, w2, w3, counts, False, dtype)


class _SwiGLU(torch.autograd.Function):
    """The experts' SwiGLU over their grouped rows, with its backward written out, so that
    autograd keeps the rows' activations and the stacked weights themselves, never a slice
    w[e] of them: a slice holds the storage of the whole gathered tensor, which DeepSpeed's
    ZeRO-3 (it releases a module's parameters after forward by swapping each one's data)
    could then not free until the block's backward (3 E h f elements a kept block; Mixtral-8x7B:
    2.8 GB in bf16). Saved: the rows, h1 = w1 x, silu(h1), h3 = w3 x, their product (as
    autograd saves them for the same ops), and the weights in the matmuls' dtype (a cast is a
    copy, kept as autograd keeps it; no cast: the parameters, which ZeRO-3 gathers again for
    backward as it does for a dense Linear's). An expert with no rows gets a zero gradient,
    as DDP's reducer and ZeRO's hooks expect of every parameter in every step."""

    @staticmethod
    def forward(ctx, x, w1, w2, w3, counts, grouped: bool, dtype: torch.dtype):
        mm = _GroupedOps(counts) if grouped else _LoopOps(counts)
        with torch.autocast(x.device.type, enabled=False):
            x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
            h1, h3 = mm.forward(x, w1), mm.forward(x, w3)
            a = F.silu(h1)
            p = a * h3
            y = mm.forward(p, w2)
        ctx.mm = mm
        ctx.save_for_backward(x, w1, w2, w3, h1, a, h3, p)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w1, w2, w3, h1, a, h3, p = ctx.saved_tensors
        mm = ctx.mm
        with torch.autocast(dy.device.type, enabled=False):
            dy = dy.to(p.dtype)
            dp = mm.input_grad(dy, w2)
            dw2 = mm.weight_grad(dy, p)
            s = torch.sigmoid(h1)
            dh1 = dp * h3 * s * (1 + h1 * (1 - s))  # silu'(h) = s (1 + h (1 - s))
            dh3 = dp * a
            dx = mm.input_grad(dh1, w1) + mm.input_grad(dh3, w3)
            dw1, dw3 = mm.weight_grad(dh1, x), mm.weight_grad(dh3, x)
        return dx, dw1, dw2, dw3, None, None, None


class _LoopOps:
    """The three products of a grouped matmul, one expert at a time (CPU, fp32)."""

    def __init__(self, counts: torch.Tensor):
        self.sizes = counts.tolist()

    def forward(self, x, w):  # rows of expert e times w[e]^T
        return torch.cat([F.linear(c, w[e]) for e, c in enumerate(torch.split(x, self.sizes))])

    def input_grad(self, dy, w):  # rows of expert e times w[e]
        return torch.cat([c @ w[e] for e, c in enumerate(torch.split(dy, self.sizes))])

    def weight_grad(self, dy, x):  # (E, out, in): expert e's rows, dy^T x
        return torch.stack([g.t() @ c for g, c in zip(torch.split(dy, self.sizes), torch.split(x, self.sizes))])


class _GroupedOps:
    """The same with torch._grouped_mm (offsets: the cumulative rows, int32)."""

    def __init__(self, counts: torch.Tensor):
        self.offs = torch.cumsum(counts, 0, dtype=torch.int32)

    def forward(self, x, w):
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=self.offs)

    def input_grad(self, dy, w):
        return torch._grouped_mm(dy, w, offs=self.offs)

    def weight_grad(self, dy, x):
        return torch._grouped_mm(dy.t(), x, offs=self.offs)

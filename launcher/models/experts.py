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
"""

from __future__ import annotations

import math

import torch
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

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(out (N, dim), rows dropped or None without a capacity) for x (N, dim), indices and
        weights (N, k)."""
        rows, order, counts = sort_by_expert(indices, self.num_experts)
        dropped = None
        if self.capacity_factor is not None:
            keep = within_capacity(counts, capacity(x.size(0) * indices.size(1), self.num_experts, self.capacity_factor))
            dropped = (~keep).sum().float()
            order, rows = order[keep], rows[keep]
            counts = torch.bincount(indices.flatten()[order], minlength=self.num_experts)
        y = expert_mlp(x[rows], self.w1, self.w2, self.w3, counts)
        y = y * weights.flatten()[order].unsqueeze(-1).to(y.dtype)
        return torch.zeros_like(x).index_add_(0, rows, y), dropped


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


def expert_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
               counts: torch.Tensor) -> torch.Tensor:
    """Rows x (sum(counts), dim), grouped by expert (counts[e] rows for expert e), through their
    expert's SwiGLU: w2 (silu(w1 x) * w3 x). Under autocast, in its dtype."""
    if (x.is_cuda and hasattr(torch, "_grouped_mm") and x.size(0) > 0 and torch.is_autocast_enabled("cuda")
            and torch.get_autocast_dtype("cuda") == torch.bfloat16):  # fp32 runs keep fp32 matmuls
        return _grouped(x, w1, w2, w3, counts)
    # An expert with no rows still runs (on none): its weights get a zero gradient, as DDP's
    # reducer and ZeRO's hooks expect of every parameter in every step.
    outs = [F.linear(F.silu(F.linear(chunk, w1[e])) * F.linear(chunk, w3[e]), w2[e])
            for e, chunk in enumerate(torch.split(x, counts.tolist()))]
    return torch.cat(outs)


def _grouped(x, w1, w2, w3, counts):
    """torch._grouped_mm over the groups (offsets: the cumulative rows, int32), in bf16 as it needs."""
    dtype = torch.bfloat16
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    with torch.autocast("cuda", enabled=False):
        xb = x.to(dtype)
        h = F.silu(torch._grouped_mm(xb, w1.to(dtype).transpose(-2, -1), offs=offs)) * \
            torch._grouped_mm(xb, w3.to(dtype).transpose(-2, -1), offs=offs)
        return torch._grouped_mm(h, w2.to(dtype).transpose(-2, -1), offs=offs).to(x.dtype)

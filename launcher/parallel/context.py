"""Context parallel (parallel.cp): the sequence split over cp ranks, attention by all-to-all
(DeepSpeed-Ulysses, Jacobs et al. 2023).

Each rank of a cp group holds T/cp consecutive positions of the same samples, so every
activation outside attention (norms, projections, the MLP, the logits) is 1/cp of the
whole. Attention needs every position: after the q, k and v projections one all-to-all
trades the sequence split for a head split, (b, T/cp, H, d) -> (b, T, H/cp, d); each
rank rotates and attends the whole sequence for its H/cp heads (causal, unchanged, no
load imbalance), and a second all-to-all trades back before the output projection.
Per layer and micro-batch that is four all-to-alls forward (q, k, v, out) and four in
backward, each moving (cp - 1)/cp of b x T/cp x H x d elements per rank, a volume that
does not grow with cp (ring attention's does). It needs the heads divisible by cp
(validated before launch); key/value heads that are not are repeated first.

The loss of a rank is the mean over its positions; the ranks of a cp group hold equal
numbers of them, so averaging gradients over dp x cp ranks (DDP over the world, FSDP
over dp_shard x cp) gives exactly the gradient of the mean over the whole sequence.
Runs on gloo (CPU) and NCCL alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class AllToAll(torch.autograd.Function):
    """dist.all_to_all_single over equal blocks of dim 0 into `out`, differentiable: the
    gradient goes back by the same exchange (block i came from rank i, so its gradient
    returns there). Plain tensors in and out (saved-tensor hooks, the activation counter
    and offload see ordinary storage), torch's stable c10d call on any backend. `out` is
    made by the caller, outside the function, as torch.distributed.nn's own (deprecated)
    all-to-all does; both must be contiguous."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()  # (and so is the buffer made like it: the exchange writes flat blocks)
        return None, AllToAll.apply(torch.empty_like(grad), grad, ctx.group), None


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(b, T/cp, H, d) on each rank -> (b, T, H/cp, d): every position, this rank's heads."""
    cp = dist.get_world_size(group)
    b, t, h, d = x.shape
    parts = x.reshape(b, t, cp, h // cp, d).permute(2, 0, 1, 3, 4).contiguous()  # head groups first
    out = AllToAll.apply(torch.empty_like(parts), parts, group)  # [i]: rank i's positions
    return out.permute(1, 0, 2, 3, 4).reshape(b, cp * t, h // cp, d)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(b, T, H/cp, d) -> (b, T/cp, H, d): the inverse of seq_to_heads."""
    cp = dist.get_world_size(group)
    b, t_all, h, d = x.shape
    t = t_all // cp
    parts = x.reshape(b, cp, t, h, d).permute(1, 0, 2, 3, 4).contiguous()  # position blocks first
    out = AllToAll.apply(torch.empty_like(parts), parts, group)  # [i]: head group i
    return out.permute(1, 2, 0, 3, 4).reshape(b, t, cp * h, d)


def attach(model: torch.nn.Module, group: dist.ProcessGroup) -> int:
    """Give every attention layer of the project's decoder (launcher/models/gpt.py's
    Attention: the modules with a `cp_group`) the cp group; the number given."""
    n = 0
    for module in model.modules():
        if hasattr(module, "cp_group"):
            module.cp_group = group
            n += 1
    return n


def local_positions(tokens: torch.Tensor, cp_rank: int, cp: int) -> torch.Tensor:
    """This rank's T/cp consecutive positions of a (b, T) batch (inputs or targets)."""
    t = tokens.shape[1] // cp
    return tokens[:, cp_rank * t : (cp_rank + 1) * t]

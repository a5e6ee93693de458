"""A mixture of experts in place of a block's feed-forward (model.moe, launcher/config/moe.py).

    x (tokens, dim) -> Router: scores, top k experts and their weights per token
                    -> Experts: each token's rows go through its k SwiGLU experts
                       (launcher/models/experts.py: grouped by expert; dispatched to
                       other ranks by all-to-all under expert parallelism)
                    -> the weighted sum of their outputs, plus the shared expert's

Load balancing: balance=aux_loss adds Switch Transformer's auxiliary loss to the training
loss (GPT.forward adds what the blocks recorded, `take_aux`); balance=bias keeps DeepSeek-V3's
per-expert bias, moved after each optimizer step (`after_step`). Each router counts the
tokens its experts got over the step (all micro-batches); `after_step` sums them over the
ranks, updates the biases and returns the step's load metrics.

Parameter names (checkpoints, init specs, Hugging Face conversion):
    layers.{i}.feed_forward.router.weight         (E, dim)
    layers.{i}.feed_forward.router.bias           (E,)  buffer, balance=bias only
    layers.{i}.feed_forward.experts.w1 / w3       (E, expert_dim, dim)
    layers.{i}.feed_forward.experts.w2            (E, dim, expert_dim)
    layers.{i}.feed_forward.shared.w1/w2/w3.weight  a SwiGLU of moe.shared_dim (shared_experts x expert_dim)
    layers.{i}.feed_forward.shared_gate.weight    (1, dim), moe.shared_gate only
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launcher.config import ModelConfig, MoEBalance, MoEConfig, MoEScore, expert_dim, shared_dim
from launcher.models.experts import Experts
from launcher.models.init import InitSpec
from launcher.models.layers import FeedForward

_AUX: list[torch.Tensor] = []
"""The auxiliary losses the MoE blocks of the current forward recorded (GPT.forward takes them)."""


class Router(nn.Module):
    """Scores each token against the E experts; picks its top k and their weights."""

    def __init__(self, dim: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.experts, dim))
        if cfg.balance == MoEBalance.bias:  # checkpointed with the model, moved by after_step, no gradient
            self.register_buffer("bias", torch.zeros(cfg.experts))
        # The step's tokens per expert, summed over micro-batches (fp32: exact to 2^24 per micro-batch).
        self.register_buffer("tokens", torch.zeros(cfg.experts), persistent=False)
        self.register_buffer("dropped", torch.zeros(()), persistent=False)
        self.aux = torch.zeros(())  # the step's last auxiliary loss (a metric)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices (N, k) long, weights (N, k) fp32) for x (N, dim)."""
        cfg = self.cfg
        logits = F.linear(x, self.weight).float()
        scores = logits.softmax(-1) if cfg.score == MoEScore.softmax else logits.sigmoid()
        choice = scores + self.bias if cfg.balance == MoEBalance.bias else scores
        indices = choice.topk(cfg.top_k, dim=-1).indices
        weights = scores.gather(-1, indices)
        if cfg.norm_topk and (cfg.top_k > 1 or cfg.score == MoEScore.sigmoid):
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = weights * cfg.route_scale
        counts = torch.bincount(indices.flatten(), minlength=cfg.experts).float()
        if torch.is_grad_enabled():
            # The loss is made again when activation checkpointing recomputes the block (it must
            # save what the first forward saved), but recorded once: by the training forward.
            aux = aux_loss(scores, counts, cfg) if cfg.balance == MoEBalance.aux_loss else None
            if not _in_backward():
                with torch.no_grad():
                    self.tokens += counts
                if aux is not None:
                    self.aux = aux.detach()
                    _AUX.append(aux * cfg.aux_loss_coef)
        return indices, weights


def aux_loss(scores: torch.Tensor, counts: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
    """Switch Transformer's load-balancing loss: E * sum_e f_e * P_e, f_e the fraction of the
    N x k routed slots expert e got (no gradient), P_e its mean (normalized) score. 1 when
    balanced; E / k when every token goes to the same k."""
    probs = scores if cfg.score == MoEScore.softmax else scores / scores.sum(-1, keepdim=True)
    fraction = counts / counts.sum()
    return cfg.experts * (fraction * probs.mean(0)).sum()


def _in_backward() -> bool:
    """Inside autograd's backward (activation checkpointing recomputing a block)."""
    return torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    """The feed-forward of an MoE block: routed experts plus the optional shared ones."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden = expert_dim(cfg)
        self.router = Router(cfg.dim, cfg.moe)
        self.experts = Experts(cfg.moe.experts, cfg.dim, hidden, cfg.moe.capacity_factor)
        self.shared = FeedForward(cfg, shared_dim(cfg)) if cfg.moe.shared_experts else None
        # Qwen2-MoE: sigmoid(w . x) scales the shared expert's output per token
        self.shared_gate = (
            nn.Linear(cfg.dim, 1, bias=False) if self.shared is not None and cfg.moe.shared_gate else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.size(-1))
        indices, weights = self.router(flat)
        out, dropped = self.experts(flat, indices, weights)
        if dropped is not None and torch.is_grad_enabled() and not _in_backward():
            self.router.dropped += dropped
        if self.shared is not None:
            shared = self.shared(flat)
            out = out + (shared if self.shared_gate is None else torch.sigmoid(self.shared_gate(flat)) * shared)
        return out.view_as(x)


def take_aux() -> torch.Tensor | None:
    """The sum of the auxiliary losses the last forward's MoE blocks recorded (times their
    coefficient), and forget them; None when there were none."""
    if not _AUX:
        return None
    total = torch.stack([a.to(_AUX[0].device) for a in _AUX]).sum()
    _AUX.clear()
    return total


def init_specs(cfg: ModelConfig, prefix: str, std: float, resid: InitSpec) -> dict[str, InitSpec]:
    """An MoE feed-forward's init: the router and every expert's w1, w3 as the dense ones,
    w2 as a residual projection."""
    specs = {
        f"{prefix}.router.weight": InitSpec(std=std),
        f"{prefix}.experts.w1": InitSpec(std=std),
        f"{prefix}.experts.w3": InitSpec(std=std),
        f"{prefix}.experts.w2": resid,
    }
    if cfg.moe.shared_experts:
        specs |= {
            f"{prefix}.shared.w1.weight": InitSpec(std=std),
            f"{prefix}.shared.w3.weight": InitSpec(std=std),
            f"{prefix}.shared.w2.weight": resid,
        }
        if cfg.moe.shared_gate:
            specs[f"{prefix}.shared_gate.weight"] = InitSpec(std=std)
    return specs


def routers(model: nn.Module) -> list[tuple[str, Router]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Router)]


@torch.no_grad()
def after_step(model: nn.Module, group=None) -> dict:
    """After an optimizer step: the step's tokens per expert summed over the ranks of `group`
    (one all-reduce for every router), balance=bias's biases moved towards the under-loaded
    experts, and the metrics: per MoE block the load's max over mean (1.0: balanced), the
    auxiliary loss, the tokens dropped. {} for a dense model."""
    found = routers(model)
    if not found:
        return {}
    # One all-reduce: every router's tokens per expert, then every router's dropped count.
    flat = _summed(torch.cat([r.tokens for _, r in found] + [torch.stack([r.dropped for _, r in found])]), group)
    experts = found[0][1].cfg.experts
    loads = flat[: len(found) * experts].view(len(found), experts)
    mean = loads.mean(-1, keepdim=True)
    for i, (_, r) in enumerate(found):
        if r.cfg.balance == MoEBalance.bias:  # towards the under-loaded experts (sign(0) = 0: no tokens, no move)
            r.bias += r.cfg.bias_update_rate * torch.sign(mean[i] - loads[i])
        r.tokens.zero_()
        r.dropped.zero_()
    ratio = (loads.max(-1).values / mean.squeeze(-1).clamp(min=1e-9)).tolist()  # one host synchronisation
    metrics = {"moe/dropped": float(flat[len(found) * experts :].sum())}
    for i, (name, r) in enumerate(found):
        block = _block(name, i)
        metrics[f"moe/load_max_over_mean/{block}"] = ratio[i]
        if r.cfg.balance == MoEBalance.aux_loss:
            metrics[f"moe/aux_loss/{block}"] = float(r.aux)
    return metrics


def _block(name: str, i: int) -> str:
    """The decoder layer index in a router's module name (wrappers add prefixes)."""
    match = re.search(r"layers\.(\d+)\.", name)
    return match.group(1) if match else str(i)


def _summed(t: torch.Tensor, group) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        t = t.clone()
        dist.all_reduce(t, group=group)
    return t

"""model.moe.*: a mixture of experts in place of each block's feed-forward (launcher/models/moe.py).

E routed SwiGLU experts per MoE block; a router scores every token against each expert and
sends it to its top k; an optional shared expert sees every token. Parameters grow with E,
the work per token with k: Mixtral-8x7B holds 46.7B parameters and runs 12.9B per token.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional


class MoEScore(str, enum.Enum):
    """How the router turns its logits into scores."""

    softmax = "softmax"
    """Softmax over all experts, then the top k (Mixtral, Qwen-MoE, gpt-oss)."""
    sigmoid = "sigmoid"
    """An independent sigmoid per expert (DeepSeek-V3): the top k's scores are normalized
    among themselves (moe.norm_topk)."""


class MoEBalance(str, enum.Enum):
    """How the router is kept from sending every token to a few experts."""

    aux_loss = "aux_loss"
    """Switch Transformer's auxiliary loss, E * sum_e f_e * P_e (the fraction of tokens each
    expert gets times its mean score), added to the loss times moe.aux_loss_coef."""
    bias = "bias"
    """DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the scores for
    the choice only (not the weights), moved after each optimizer step by moe.bias_update_rate
    towards the under-loaded experts (sign of mean load - load)."""
    none = "none"


@dataclass
class MoEConfig:
    """model.moe.*: `make train ARGS="model=moe_tiny"`; off (a dense model) with experts=0."""

    experts: int = 0
    """Routed experts E per MoE block (0: a dense model, every field below unused)."""
    top_k: int = 2
    """Experts each token goes to (1 <= top_k <= experts). The work per token grows with it."""
    expert_dim: Optional[int] = None
    """Each expert's SwiGLU hidden size (null: model.ffn_dim's). Fine-grained MoEs use small
    experts (Qwen3-30B-A3B: 768, DeepSeek-V3: 2048) and many of them."""
    shared_experts: int = 0
    """Experts every token goes through besides its routed ones (DeepSeek-V3: 1), as one SwiGLU
    of shared_experts x expert_dim (or moe.shared_dim)."""
    shared_dim: Optional[int] = None
    """The shared expert's SwiGLU hidden size (null: shared_experts x expert_dim; Qwen1.5-MoE-A2.7B:
    5632, four experts' worth)."""
    shared_gate: bool = False
    """Scale the shared expert's output per token by sigmoid(w . x), w a (1, dim) weight (Qwen2-MoE's
    shared_expert_gate): the token decides how much of it to take."""
    first_dense: int = 0
    """The first this-many blocks keep a dense feed-forward of model.ffn_dim (DeepSeek-V3: 3)."""
    score: MoEScore = MoEScore.softmax
    """softmax | sigmoid (MoEScore)."""
    norm_topk: bool = True
    """Renormalize the top k's scores to sum to 1 (Mixtral, Qwen3-MoE, DeepSeek-V3)."""
    route_scale: float = 1.0
    """Multiplies the routed experts' weights (DeepSeek-V3: 2.5)."""
    balance: MoEBalance = MoEBalance.aux_loss
    """aux_loss | bias | none (MoEBalance)."""
    aux_loss_coef: float = 0.01
    """balance=aux_loss: the auxiliary loss's weight (Switch: 0.01; Mixtral: 0.02)."""
    bias_update_rate: float = 0.001
    """balance=bias: how far each expert's bias moves per optimizer step (DeepSeek-V3: 0.001)."""
    capacity_factor: Optional[float] = None
    """Tokens an expert takes per micro-batch, as a multiple of its fair share (tokens x k / E);
    those over it are dropped (their routed output is zero, the residual carries them) and
    counted (moe/dropped). null: no token is dropped (dispatch buffers sized by the actual
    load, up to every token on one expert)."""


def moe_key(m) -> tuple:
    """A MoEConfig's fields as a hashable key (the decoder's shape key holds it)."""
    return tuple(sorted(vars(m).items()))

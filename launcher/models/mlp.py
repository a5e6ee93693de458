"""The dense feed-forward of a decoder block: a SwiGLU MLP. Its own module so that the dense
decoder (gpt.py) and an MoE block's shared expert (moe.py) both build it, neither importing
the other."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from launcher.config import ModelConfig, ffn_dim


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: ModelConfig, hidden: int | None = None):
        super().__init__()
        hidden = hidden or ffn_dim(cfg)  # an MoE's shared expert: its own width
        self.w1 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

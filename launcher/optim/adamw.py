"""adamw: torch's AdamW, two fp32 moments (8 bytes a trainable parameter); fused on CUDA."""

from __future__ import annotations

from launcher.config import OptimConfig


def state_bytes(cfg: OptimConfig, t) -> int:
    return 8 * t.held


def validate(cfg: OptimConfig) -> None:
    pass


def build(groups: list[dict], model, cfg: OptimConfig, device):
    import torch  # local: torch (launch side)

    fused = cfg.fused if cfg.fused is not None else device.type == "cuda"
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused or None)

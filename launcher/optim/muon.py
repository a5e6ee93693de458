"""muon: Muon (Jordan et al., 2024; torch.optim.Muon's update) for the hidden matrices,
AdamW for the rest (the token embedding, the output head, norms and biases), as the Muon
authors recommend, in one optimizer (launcher/optim/classes.py::MuonAdamW): one set of
param groups for the schedule, one state dict for the checkpoints.

A matrix keeps one fp32 momentum (4 bytes an element); the rest AdamW's two moments (8).
The momentum is orthogonalised by optim.muon_ns_steps Newton-Schulz iterations in bf16,
which need the whole matrix: a sharded matrix (FSDP, TP: a DTensor) is gathered one at a
time, every rank orthogonalises it (as every ddp rank does) and applies its own shard, so
the update equals an unsharded one (one all-gather of each matrix's update per step, and
the ns_steps x 3 matmuls of each matrix on every rank).
"""

from __future__ import annotations

from launcher.config import ConfigError, OptimConfig
from launcher.optim import MUON_ADJUST


def takes(t) -> bool:
    """Muon's part: the 2-D parameters other than the embedding and the head."""
    return len(t.shape) == 2 and not t.embedding


def state_bytes(cfg: OptimConfig, t) -> int:
    return (4 if takes(t) else 8) * t.held


def validate(cfg: OptimConfig) -> None:
    if cfg.muon_adjust_lr not in MUON_ADJUST:
        raise ConfigError("optim.muon_adjust_lr", cfg.muon_adjust_lr, f"allowed: {', '.join(MUON_ADJUST)}")
    if not 0 <= cfg.muon_momentum < 1:
        raise ConfigError("optim.muon_momentum", cfg.muon_momentum, "must be in [0, 1)")
    if not 1 <= cfg.muon_ns_steps < 100:
        raise ConfigError("optim.muon_ns_steps", cfg.muon_ns_steps, "must be in [1, 99]")


def build(groups: list[dict], model, cfg: OptimConfig, device):
    from launcher.optim.classes import MuonAdamW, muon_groups  # local: torch (launch side)

    fused = cfg.fused if cfg.fused is not None else device.type == "cuda"
    extra = dict(
        momentum=cfg.muon_momentum,
        nesterov=cfg.muon_nesterov,
        ns_steps=cfg.muon_ns_steps,
        adjust_lr_fn=cfg.muon_adjust_lr,
    )
    return MuonAdamW(
        muon_groups(groups, model, extra), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused or None
    )

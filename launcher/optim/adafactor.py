"""adafactor: torch's Adafactor (Shazeer and Stern, 2018): no first moment, and the second
moment of a matrix kept as its row and column means (4 bytes x (rows + columns)); a vector
keeps it whole (4 bytes an element). The step is relative: lr x the parameter's RMS, the
lr capped at 1/sqrt(step), the update clipped to RMS optim.adafactor_clip.

Its statistics need whole rows and columns, so a sharded parameter (FSDP, TP: a DTensor)
is stepped whole: its gradient and the parameter are gathered one tensor at a time, every
rank keeps the (small) whole statistics and writes back its own shard
(launcher/optim/classes.py::WholeAdafactor): the same numbers as an unsharded step, at
one all-gather of each matrix and its gradient per step.
"""

from __future__ import annotations

import math

from launcher.config import ConfigError, OptimConfig


def state_bytes(cfg: OptimConfig, t) -> int:
    if len(t.shape) < 2:
        return 4 * t.numel
    rows = math.prod(t.shape[:-1])
    cols = math.prod(t.shape[:-2]) * t.shape[-1]
    return 4 * (rows + cols)


def validate(cfg: OptimConfig) -> None:
    if cfg.adafactor_beta2_decay > 0:
        raise ConfigError("optim.adafactor_beta2_decay", cfg.adafactor_beta2_decay, "must be <= 0")
    if cfg.adafactor_clip < 1:
        raise ConfigError("optim.adafactor_clip", cfg.adafactor_clip, "must be >= 1")


def build(groups: list[dict], model, cfg: OptimConfig, device):
    from launcher.optim.classes import WholeAdafactor  # local: torch (launch side)

    return WholeAdafactor(groups, lr=cfg.lr, beta2_decay=cfg.adafactor_beta2_decay, d=cfg.adafactor_clip)

"""The optimizers (`optim.name`, one conf/optim/<name>.yaml each), one module per family:

    adamw.py      adamw                  torch's AdamW: two fp32 moments, 8 bytes a parameter
    lowbit.py     adamw8bit, adamw4bit   torchao's AdamW8bit/4bit: block-wise quantized moments
    adafactor.py  adafactor              torch's Adafactor: factored second moment, no first
    muon.py       muon                   Muon's update for hidden matrices, AdamW for the rest

Each family declares `state_bytes(cfg, t)` (the bytes of state it keeps for one trainable
tensor as a rank holds it: the planner's optimizer term) and `build(groups, model, cfg,
device)` (the rank's optimizer, one torch.optim.Optimizer the engines, the schedule and
the checkpoints treat like AdamW). This package and the families import no torch when
imported: the launch side reads names, refusals and bytes from it (`make plan`,
validation); the optimizer classes are launcher/optim/classes.py, imported by `build`.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from dataclasses import dataclass
from typing import Iterable

from launcher.config import ConfigError, OptimConfig

FAMILIES = {"adamw": "adamw", "adamw8bit": "lowbit", "adamw4bit": "lowbit", "adafactor": "adafactor", "muon": "muon"}
"""optim.name -> its module in this package."""

NAMES = tuple(FAMILIES)

ZERO_TAKES = ("adamw",)
"""What the zero recipes run: DeepSpeed's own AdamW (ds_config.json's optimizer section).
ZeRO hands a client optimizer flat 1-D partitions of every group, so Adafactor's factored
rows and columns and Muon's matrices no longer exist, and the low-bit moments would miss
DeepSpeed's universal checkpoint (resharding) and its offload path."""

MUON_ADJUST = ("match_rms_adamw", "original")


@dataclass(frozen=True)
class Trainable:
    """One trainable parameter as a rank holds it (the planner's input: another part of
    the planner decides which parameters train)."""

    shape: tuple[int, ...]
    """The whole parameter's shape."""
    held: int
    """Elements this rank holds of it (its shard under FSDP/TP; the whole numel when replicated)."""
    embedding: bool = False
    """The token embedding or the output head (muon gives them to AdamW)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def family(name: str):
    """The module of `optim.name` (launcher/optim/<family>.py)."""
    return importlib.import_module(f"launcher.optim.{FAMILIES[name]}")


def state_bytes(cfg: OptimConfig, tensors: Iterable[Trainable]) -> int:
    """Bytes of optimizer state a rank keeps for these trainable tensors (the step counters,
    4 bytes a tensor, left out)."""
    fam = family(cfg.name)
    return sum(fam.state_bytes(cfg, t) for t in tensors)


def build(groups: list[dict], model, cfg: OptimConfig, device):
    """The rank's optimizer for `groups` (launcher.rank.engine.param_groups of `model`)."""
    return family(cfg.name).build(groups, model, cfg, device)


def validate(cfg: OptimConfig, recipe: str, deepspeed: bool, fsdp_cpu_offload: bool, cuda: bool) -> None:
    """The optimizer's own checks on the launch side; one ConfigError each."""
    if not cfg.lr > 0:
        raise ConfigError("optim.lr", cfg.lr, "must be > 0")
    if cfg.name not in FAMILIES:
        raise ConfigError("optim.name", cfg.name, f"allowed: {', '.join(NAMES)}")
    if cfg.name.startswith("adamw") and cfg.name != "adamw" and importlib.util.find_spec("torchao") is None:
        raise ConfigError(
            "optim.name",
            cfg.name,
            "needs torchao's low-bit states, the fp8 extra (.venv/bin/pip install "
            "-e '.[fp8]'); adamw, adafactor and muon need none",
        )
    if deepspeed and cfg.name not in ZERO_TAKES:
        raise ConfigError(
            "optim.name",
            cfg.name,
            f"recipe={recipe} runs DeepSpeed's own AdamW on flat partitions; "
            f"{cfg.name} runs under recipe=ddp, fsdp, tp, tp_fsdp, pp or pp_fsdp",
        )
    if cfg.fused and cfg.name not in ("adamw", "muon"):
        raise ConfigError(
            "optim.fused", cfg.fused, f"fused is torch's AdamW kernel (adamw, muon); {cfg.name} has none: use null"
        )
    if fsdp_cpu_offload and cuda and cfg.name in ("adafactor", "muon"):
        raise ConfigError(
            "optim.name",
            cfg.name,
            f"{cfg.name} gathers each matrix on the device for its step; with "
            f"recipe.fsdp.cpu_offload=true the shards live in host memory: use "
            f"adamw, adamw8bit or adamw4bit",
        )
    family(cfg.name).validate(cfg)
    if not 0 <= cfg.min_lr_ratio <= 1:
        raise ConfigError("optim.min_lr_ratio", cfg.min_lr_ratio, "must be in [0, 1]")
    for key in ("beta1", "beta2"):
        if not 0 <= getattr(cfg, key) < 1:
            raise ConfigError(f"optim.{key}", getattr(cfg, key), "must be in [0, 1)")
    if cfg.weight_decay < 0:
        raise ConfigError("optim.weight_decay", cfg.weight_decay, "must be >= 0")
    if cfg.grad_clip < 0:
        raise ConfigError("optim.grad_clip", cfg.grad_clip, "must be >= 0 (0 = off)")
    if cfg.fused and not cuda:
        raise ConfigError("optim.fused", cfg.fused, "fused AdamW needs CUDA; this machine has none (use null)")

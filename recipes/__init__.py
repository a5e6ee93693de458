"""The recipes' engines: `recipe.strategy` names a row of launcher.config.STRATEGIES, whose
`module` builds the engine. Modules are imported on first use, so a DDP run never imports
DeepSpeed."""

from __future__ import annotations

import importlib

from launcher.config import STRATEGIES


def module(cfg):
    """The recipe's module, imported on first use (DeepSpeed's told its accelerator first:
    it reads DS_ACCELERATOR when imported, and would probe and warn on a CPU machine)."""
    name = STRATEGIES[cfg.recipe.strategy].module
    if name == "recipes.zero":
        from launcher.device import deepspeed_env

        deepspeed_env()
    return importlib.import_module(name)


def build(ctx):
    """The engine for `ctx.cfg.recipe.strategy` (see launcher.engine.Engine)."""
    return module(ctx.cfg).build(ctx)


def consolidate(cfg, engine_dir):
    """Full fp32 weights from a checkpoint's engine/ folder, on one process (export)."""
    return module(cfg).consolidate(cfg, engine_dir)

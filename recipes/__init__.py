"""The recipe registry: a plain dict from `recipe.strategy` to the module that builds
its engine. Modules are imported on first use, so a DDP run never imports DeepSpeed."""

from __future__ import annotations

import importlib

RECIPES: dict[str, str] = {
    "ddp": "recipes.ddp",
    "fsdp": "recipes.fsdp",
    "tp": "recipes.tp",
    "tp_fsdp": "recipes.tp_fsdp",
    "pp": "recipes.pp",
    "zero": "recipes.zero",
}


def module(cfg):
    """The recipe's module, imported on first use."""
    return importlib.import_module(RECIPES[cfg.recipe.strategy.value])


def build(ctx):
    """The engine for `ctx.cfg.recipe.strategy` (see launcher.engine.Engine)."""
    return module(ctx.cfg).build(ctx)


def consolidate(cfg, engine_dir):
    """Full fp32 weights from a checkpoint's engine/ folder, on one process (export)."""
    return module(cfg).consolidate(cfg, engine_dir)

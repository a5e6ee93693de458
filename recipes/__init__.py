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
    """The recipe's module, imported on first use (DeepSpeed's told its accelerator first:
    it reads DS_ACCELERATOR when imported, and would probe and warn on a CPU machine)."""
    name = RECIPES[cfg.recipe.strategy.value]
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

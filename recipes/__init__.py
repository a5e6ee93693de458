"""The recipe registry: a plain dict from `recipe.strategy` to the module that builds
its engine. Modules are imported on first use, so a DDP run never imports DeepSpeed."""

from __future__ import annotations

import importlib

RECIPES: dict[str, str] = {
    "ddp": "recipes.ddp",
}


def build(ctx):
    """The engine for `ctx.cfg.recipe.strategy` (see launcher.engine.Engine)."""
    return importlib.import_module(RECIPES[ctx.cfg.recipe.strategy.value]).build(ctx)

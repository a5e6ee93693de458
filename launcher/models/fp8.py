"""precision=fp8: the blocks' linear layers swapped for torchao's Float8Linear (rowwise
scales, as torchtitan's "rowwise" recipe), before the recipe parallelizes (on the meta
device: the swap keeps each weight Parameter and its name, so init, checkpoints and
export see the model they always see). Not the head (the logits' precision matters most
and torchtitan leaves it out too), nor a layer whose dimensions are not multiples of 16
(float8 matmuls need them). The launch side checked the machine, the recipe and torchao
(launcher/launch/checks/levers.py)."""

from __future__ import annotations

import dataclasses

from torch import nn

from launcher.config import Config


def convert(model: nn.Module, cfg: Config, head: str) -> None:
    """Swap the qualifying nn.Linear layers in place."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # local: optional (torchao)

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), emulate=cfg.precision.fp8_emulate)

    def qualifies(module: nn.Module, name: str) -> bool:
        return (
            isinstance(module, nn.Linear)
            and name.split(".")[-1] != head.split(".")[-1]
            and module.in_features % 16 == 0
            and module.out_features % 16 == 0
        )

    convert_to_float8_training(model, config=config, module_filter_fn=qualifies)

"""precision=fp8 (issue 17, item 4): the blocks' linear layers become torchao's Float8Linear
(rowwise scales), on the meta device before the recipe parallelizes, keeping every
parameter's name; the head stays. On CPU the float8 matmuls run emulated
(precision.fp8_emulate=true), which is how these tests and the e2e run train; the launch
side refuses fp8 where it cannot run (tests/unit/test_bad_input.py)."""

from __future__ import annotations

import torch
from torchao.float8.float8_linear import Float8Linear

from launcher import models
from launcher.launch import cli

FP8 = ["model=gpt_tiny", "precision=fp8", "precision.fp8_emulate=true"]


def test_the_blocks_linears_are_float8_the_head_is_not_and_names_are_kept():
    cfg, _, _ = cli.compose_config(FP8)
    plain = models.on_meta(cli.compose_config(["model=gpt_tiny"])[0])
    model = models.prepare(models.on_meta(cfg), cfg)
    swapped = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    linears = {n for n, m in plain.named_modules() if isinstance(m, torch.nn.Linear) and n != "output"}
    assert swapped == linears and len(swapped) == 7 * cfg.model.n_layers
    assert not isinstance(model.output, Float8Linear)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert cfg.precision.name.value == "bf16" and cfg.precision.fp8


def test_an_emulated_float8_step_is_close_to_bf16():
    torch.manual_seed(0)
    x = torch.randint(0, 256, (4, 65))
    losses, grads = {}, {}
    for name, overrides in (("bf16", ["model=gpt_tiny"]), ("fp8", FP8)):
        cfg, _, _ = cli.compose_config(overrides)
        torch.manual_seed(0)
        model = models.prepare(models.build(cfg, torch.device("cpu")), cfg)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        losses[name] = loss.item()
        grads[name] = torch.cat([p.grad.float().flatten() for p in model.parameters()])
    assert abs(losses["fp8"] / losses["bf16"] - 1) < 0.01, losses
    cosine = torch.nn.functional.cosine_similarity(grads["fp8"], grads["bf16"], dim=0)
    assert cosine > 0.99, cosine

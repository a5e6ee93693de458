"""train.activation_checkpointing=op (issue 16, item 3): every block keeps the outputs of
attention and of every other matmul and recomputes the rest in backward
(launcher/models/gpt.py::keep_matmuls, as torchtitan's op-level SAC). The gradients equal those of no recomputation, and
what forward leaves for backward, seen by torch's MemTracker (which also sees the selective
policy's cache, where autograd's saved-tensor hooks do not), matches the planner's
activation bytes (launcher/planner/memory.py::op_kept), beside none and full."""

from __future__ import annotations

import pytest
import torch
from hf_models import tiny_llama_config
from torch.distributed._tools.mem_tracker import MemTracker

from launcher import models
from launcher.config import ACMode, Precision
from launcher.launch import cli
from launcher.models.gpt import GPT, set_activation_checkpointing
from launcher.planner import memory as M
from launcher.planner.footprint import Layout, numerics


def forward_and_backward(model, x, dtype):
    """Bytes forward leaves for backward (MemTracker's activations and temporaries when the
    loss exists), then the gradients."""
    model.zero_grad(set_to_none=True)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = model(x[:, :-1], x[:, 1:])
        now = next(v for k, v in tracker.get_tracker_snapshot("current").items() if str(k) == "cpu")
        held = sum(v for k, v in now.items() if str(k).split(".")[-1] in ("ACT", "TEMP"))
        loss.backward()
    return held, loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_op_level_recompute_keeps_what_the_planner_says(precision):
    V, s, b = 4096, 128, 2
    # grouped-query attention (2 KV heads of 6): k and v are kept before the repeat
    cfg, _, _ = cli.compose_config(
        ["model=gpt_small", "model.n_layers=3", f"model.vocab_size={V}", f"model.max_seq_len={s}", "model.n_kv_heads=2"]
    )
    torch.manual_seed(0)
    model = GPT(cfg.model)
    x = torch.randint(0, V, (b, s + 1))
    dtype = torch.bfloat16 if precision == "bf16" else None
    n = numerics(Precision(precision), Layout("ddp", 1))
    held, losses, grads = {}, {}, {}
    for ac in (ACMode.none, ACMode.full, ACMode.op):
        set_activation_checkpointing(model, ac, 2)
        held[ac], losses[ac], grads[ac] = forward_and_backward(model, x, dtype)
        planned = M.activation_bytes(cfg.model, b, s, n, ac)
        print(f"{precision} {ac.value}: {held[ac] / 2**20:.2f} MiB measured, {planned / 2**20:.2f} planned")
        assert abs(planned / held[ac] - 1) < 0.02, ac  # the issue asks 15% for op
    assert held[ACMode.full] < held[ACMode.op] < 0.5 * held[ACMode.none]
    assert torch.equal(losses[ACMode.op], losses[ACMode.none])
    for k, g in grads[ACMode.none].items():  # the same kernels run again: equal to rounding
        torch.testing.assert_close(grads[ACMode.op][k], g, rtol=1e-5 if dtype is None else 2e-2, atol=1e-6)


def test_a_hugging_face_model_recomputes_at_op_level(tmp_path):
    """model=hf: the model's own checkpointing, handed the same policy."""
    config = tiny_llama_config(tmp_path)
    x = torch.randint(0, 300, (2, 65))
    held, grads = {}, {}
    for mode in ("none", "full", "op"):
        cfg, _, _ = cli.compose_config(["model=hf", f"model.config={config}", f"train.activation_checkpointing={mode}"])
        torch.manual_seed(0)
        model = models.build(cfg, torch.device("cpu"))
        models.set_activation_checkpointing(model, cfg)
        held[mode], _, grads[mode] = forward_and_backward(model, x, None)
    assert held["full"] < held["op"] < held["none"], held
    for k, g in grads["none"].items():
        torch.testing.assert_close(grads["op"][k], g, rtol=1e-5, atol=1e-6)

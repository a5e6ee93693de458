"""train.activation_offload (issue 16, item 2): what the blocks save for backward is moved
to host memory in forward and brought back in backward (launcher/models/offload.py). On CPU
the copies are real, synchronous and save nothing (host is device); what is checked here is
that the hooks see what the planner says moves (its host activation bytes), that the rest is
the planner's device part, and that training is unchanged bit for bit."""

from __future__ import annotations

import pytest
import torch

from launcher.config import ACMode, Precision
from launcher.launch import cli
from launcher.models.gpt import GPT, set_activation_checkpointing
from launcher.planner import memory as M
from launcher.planner.footprint import Layout, activations, numerics


def step(model, x, dtype, offload: bool):
    model.offload_activations = offload
    model.zero_grad(set_to_none=True)
    with M.ActivationCounter(model) as counter:
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
    return counter.bytes, loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize(
    "precision, ac", [("fp32", "none"), ("bf16", "none"), ("fp32", "selective"), ("bf16", "full"), ("fp32", "op")]
)
def test_the_offloaded_bytes_are_the_planners_host_part_and_training_is_unchanged(precision, ac):
    V, s, b = 4096, 128, 2
    overrides = [
        "model=gpt_small",
        "model.n_layers=4",
        f"model.vocab_size={V}",
        f"model.max_seq_len={s}",
        "model.n_kv_heads=2",
        f"train.seq_len={s}",
        f"train.micro_batch={b}",
        f"precision={precision}",
        f"train.activation_checkpointing={ac}",
        "train.activation_offload=true",
    ]
    cfg, _, _ = cli.compose_config(overrides)
    torch.manual_seed(0)
    model = GPT(cfg.model)
    set_activation_checkpointing(model, ACMode(ac), cfg.train.ac_every)
    x = torch.randint(0, V, (b, s + 1))
    dtype = torch.bfloat16 if precision == "bf16" else None
    whole, loss, grads = step(model, x, dtype, offload=False)
    outside, loss_off, grads_off = step(model, x, dtype, offload=True)
    moved = model._offload.offloaded_bytes
    layout = Layout("ddp", 1)
    device, host = activations(cfg, layout, ACMode(ac), b), activations(cfg, layout, ACMode(ac), b, where="host")
    planned_whole = M.activation_bytes(cfg.model, b, s, numerics(Precision(precision), layout), ACMode(ac))
    print(
        f"{precision} {ac}: moved {moved / 2**20:.2f} MiB (planned {host / 2**20:.2f}), left "
        f"{(whole - moved) / 2**20:.2f} (planned {device / 2**20:.2f}) of {whole / 2**20:.2f} (planned {planned_whole / 2**20:.2f})"
    )
    assert device + host == planned_whole
    assert abs(moved / host - 1) < 0.01
    if ac != "op":  # autograd's hooks do not see op-level recomputation's cache (test_op_recompute measures it)
        assert abs((whole - moved) / device - 1) < 0.01
    assert outside < whole - moved  # what autograd saves outside the offloaded blocks
    assert torch.equal(loss_off, loss)
    for k, g in grads.items():  # exact copies: the same gradients, bit for bit
        assert torch.equal(grads_off[k], g), k
    assert all(ref() is None for ref in model._offload.order)  # backward freed every host and device copy


def test_an_offloaded_step_under_no_grad_moves_nothing():
    cfg, _, _ = cli.compose_config(["model=gpt_tiny"])
    model = GPT(cfg.model)
    model.offload_activations = True
    with torch.no_grad():
        model(torch.randint(0, 256, (2, 64)))
    assert model._offload is None


def test_a_forward_dropped_without_backward_frees_its_copies_and_the_next_step_counts_afresh():
    """An out-of-memory error after forward (train.oom_backoff retries the step): the graph
    is dropped, and with it every host copy; the retried step's count starts at zero."""
    cfg, _, _ = cli.compose_config(
        ["model=gpt_small", "model.n_layers=2", "model.vocab_size=4096", "model.max_seq_len=128"]
    )
    model = GPT(cfg.model)
    model.offload_activations = True
    x = torch.randint(0, 4096, (2, 129))
    loss = model(x[:, :-1], x[:, 1:])
    once = model._offload.offloaded_bytes
    assert once > 0 and any(ref() is not None for ref in model._offload.order)
    del loss  # the failed step's graph
    assert all(ref() is None for ref in model._offload.order)
    loss = model(x[:, :-1], x[:, 1:])
    loss.backward(retain_graph=True)
    loss.backward()  # a second backward unpacks every saved tensor again
    assert model._offload.offloaded_bytes == once

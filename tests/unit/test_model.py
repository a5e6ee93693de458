"""The decoder: parameter counts, FLOPs, activation checkpointing, causality."""

from __future__ import annotations

import pytest
import torch

from launcher.config import ACMode, num_params
from launcher.launch import cli
from launcher.models.gpt import GPT, flops_per_token, set_activation_checkpointing


@pytest.mark.parametrize(
    "name",
    ["gpt_tiny", "gpt_small", "gpt_125m", "gpt_350m", "gpt_1b", "gpt_7b", "llama3_8b", "llama3_70b", "llama3_405b"],
)
def test_param_count_formula_matches_the_module(name):
    cfg, _, _ = cli.compose_config([f"model={name}"])
    with torch.device("meta"):
        model = GPT(cfg.model)
    assert model.num_params() == num_params(cfg.model)


def test_sizes_are_what_their_names_say():
    counts = {}
    for name in [
        "gpt_tiny",
        "gpt_small",
        "gpt_125m",
        "gpt_350m",
        "gpt_1b",
        "gpt_7b",
        "llama3_8b",
        "llama3_70b",
        "llama3_405b",
    ]:
        cfg, _, _ = cli.compose_config([f"model={name}"])
        counts[name] = num_params(cfg.model)
    assert counts["gpt_tiny"] < 10e6
    assert 100e6 < counts["gpt_125m"] < 150e6
    assert 300e6 < counts["gpt_350m"] < 420e6
    assert 1.0e9 < counts["gpt_1b"] < 1.2e9
    assert 6.5e9 < counts["gpt_7b"] < 7.0e9  # Llama-2-7B: 6.74B
    # Meta's published counts: 8.03B, 70.6B, 405.9B (GQA with 8 KV heads, untied 128k vocabulary)
    assert round(counts["llama3_8b"] / 1e9, 2) == 8.03
    assert round(counts["llama3_70b"] / 1e9, 1) == 70.6
    assert round(counts["llama3_405b"] / 1e9, 1) == 405.9


def test_flops_per_token_is_six_n_plus_attention():
    cfg, _, _ = cli.compose_config(["model=gpt_125m"])
    m = cfg.model
    f = flops_per_token(m, 1024)
    # 6N (matmul weights, head included) + 12 L d T
    assert f > 6 * (num_params(m) - m.vocab_size * m.dim)
    assert f == pytest.approx(6 * (num_params(m) - m.dim * (2 * m.n_layers + 1)) + 12 * m.n_layers * m.dim * 1024)


def tiny():
    cfg, _, _ = cli.compose_config(["model=gpt_tiny"])
    torch.manual_seed(0)
    return GPT(cfg.model), cfg


def test_loss_at_init_is_near_uniform():
    model, cfg = tiny()
    x = torch.randint(0, 256, (2, 32))
    loss = model(x[:, :-1], x[:, 1:])
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.2


def test_causal_future_tokens_do_not_change_past_logits():
    model, _ = tiny()
    x = torch.randint(0, 256, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 256
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.allclose(a[0, :10], b[0, :10], atol=1e-6)
    assert not torch.allclose(a[0, 10:], b[0, 10:])


@pytest.mark.parametrize("mode", [ACMode.full, ACMode.selective])
def test_activation_checkpointing_gives_the_same_gradients(mode):
    model, _ = tiny()
    x = torch.randint(0, 256, (2, 33))
    model(x[:, :-1], x[:, 1:]).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    set_activation_checkpointing(model, mode, every=2)
    assert model.checkpointed == ({0, 1, 2, 3} if mode == ACMode.full else {0, 2})
    model(x[:, :-1], x[:, 1:]).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=0, atol=0)


def test_tied_embeddings_share_one_tensor():
    model, _ = tiny()
    assert model.output.weight is model.tok_embeddings.weight
    names = {n for n, _ in model.named_parameters()}
    assert "output.weight" not in names  # counted once

"""The mixture-of-experts decoder (launcher/models/moe.py, experts.py): its arithmetic against a
token-by-token reference, capacity, balancing, counts and initialisation. Runs under the
recipes: tests/e2e/test_moe_runs.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from launcher.config import ModelConfig, MoEBalance, MoEConfig, MoEScore, num_params
from launcher.models import moe
from launcher.models.experts import capacity
from launcher.models.gpt import GPT, init_specs


def shape(name: str) -> ModelConfig:
    """conf/model/<name>.yaml as composed by the launcher."""
    from launcher.launch.compose import compose_config

    return compose_config([f"model={name}"])[0].model


def small(**moe_fields) -> ModelConfig:
    return ModelConfig(
        dim=64, n_layers=3, n_heads=4, moe=MoEConfig(**({"experts": 4, "top_k": 2, "expert_dim": 32} | moe_fields))
    )


def reference(ff: moe.MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the weighted sum of its top-k experts' SwiGLUs, plus the shared expert."""
    idx, w = ff.router(x)
    e = ff.experts
    rows = [
        sum(
            w[t, j] * F.linear(F.silu(F.linear(x[t], e.w1[i])) * F.linear(x[t], e.w3[i]), e.w2[i])
            for j, i in enumerate(idx[t].tolist())
        )
        for t in range(x.size(0))
    ]
    out = torch.stack(rows)
    return out + ff.shared(x) if ff.shared is not None else out


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"shared_experts": 1},
        {"score": MoEScore.sigmoid, "balance": MoEBalance.bias, "route_scale": 2.5, "top_k": 3},
    ],
)
def test_the_moe_block_equals_token_by_token_experts(fields):
    torch.manual_seed(0)
    ff = GPT(small(**fields)).layers[1].feed_forward
    x = torch.randn(37, 64)
    with torch.no_grad():
        assert (ff(x) - reference(ff, x)).abs().max() < 1e-5


def test_weights_follow_the_router_rule():
    torch.manual_seed(0)
    router = GPT(small(top_k=2)).layers[0].feed_forward.router
    x = torch.randn(5, 64)
    with torch.no_grad():
        idx, w = router(x)
        probs = F.linear(x, router.weight).softmax(-1)
        top = probs.topk(2).values
        assert torch.allclose(w, top / top.sum(-1, keepdim=True)) and torch.equal(idx, probs.topk(2).indices)


def test_capacity_drops_each_experts_latest_rows_and_counts_them():
    torch.manual_seed(0)
    ff = GPT(small(capacity_factor=0.5)).layers[0].feed_forward
    x = torch.randn(40, 64)
    with torch.no_grad():
        idx, w = ff.router(x)
        out, dropped = ff.experts(x, idx, w)
        cap = capacity(40 * 2, 4, 0.5)
        counts = torch.bincount(idx.flatten(), minlength=4)
        assert cap == 10 and dropped == (counts - cap).clamp(min=0).sum() > 0
        # the kept rows: per expert, the first `cap` (token, slot) pairs in token order
        seen = [0] * 4
        expect = torch.zeros_like(x)
        e = ff.experts
        for t in range(40):
            for j, i in enumerate(idx[t].tolist()):
                if seen[i] < cap:
                    expect[t] += w[t, j] * F.linear(F.silu(F.linear(x[t], e.w1[i])) * F.linear(x[t], e.w3[i]), e.w2[i])
                seen[i] += 1
        assert (out - expect).abs().max() < 1e-5


def test_aux_loss_is_one_when_balanced_and_e_over_k_when_collapsed():
    cfg = MoEConfig(experts=4, top_k=2)
    uniform = torch.full((8, 4), 0.25)
    assert moe.aux_loss(uniform, torch.full((4,), 4.0), cfg).item() == pytest.approx(1.0)
    collapsed = torch.tensor([[0.5, 0.5, 0.0, 0.0]] * 8)
    assert moe.aux_loss(collapsed, torch.tensor([8.0, 8.0, 0.0, 0.0]), cfg).item() == pytest.approx(4 / 2)


def test_training_adds_the_aux_loss_and_evaluation_does_not():
    torch.manual_seed(0)
    model = GPT(small(aux_loss_coef=0.5))
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        plain = model(x, y)
    trained = model(x, y)
    aux = sum(r.aux for _, r in moe.routers(model)) * 0.5
    assert trained.item() == pytest.approx(plain.item() + aux.item(), rel=1e-5) and aux > 0
    trained.backward()
    assert model.layers[0].feed_forward.router.weight.grad.abs().sum() > 0


def test_after_step_moves_the_bias_towards_the_idle_experts_and_reports_the_load():
    torch.manual_seed(0)
    model = GPT(small(balance=MoEBalance.bias, score=MoEScore.sigmoid))
    model.init_buffers()
    model(torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))).backward()
    routers = moe.routers(model)
    loads = [r.tokens.clone() for _, r in routers]
    metrics = moe.after_step(model)
    for (name, r), load in zip(routers, loads):
        assert load.sum() == 2 * 16 * 2  # every token's k slots
        assert torch.equal(r.bias, 0.001 * torch.sign(load.mean() - load)) and r.tokens.sum() == 0
        assert metrics[f"moe/load_max_over_mean/{name.split('.')[1]}"] == pytest.approx(
            (load.max() / load.mean()).item()
        )
    assert metrics["moe/dropped"] == 0 and not any(k.startswith("moe/aux_loss") for k in metrics)


@pytest.mark.parametrize("name", ["moe_tiny", "deepseek_v3", "mixtral_8x7b"])
def test_counts_from_the_config_match_the_built_model(name):
    from launcher.models.init import skip_torch_init

    cfg = shape(name)
    with torch.device("meta"), skip_torch_init():
        model = GPT(cfg)
    assert model.num_params() == num_params(cfg)
    assert set(init_specs(cfg)) == {n for n, _ in model.named_parameters()}
    dense = cfg.moe.first_dense
    assert type(model.layers[dense].feed_forward).__name__ == "MoE"
    assert dense == 0 or type(model.layers[dense - 1].feed_forward).__name__ == "FeedForward"
    routed = (cfg.moe.experts - cfg.moe.top_k) * 3 * cfg.dim * (cfg.moe.expert_dim or cfg.ffn_dim)
    assert num_params(cfg) - num_params(cfg, active=True) == (cfg.n_layers - dense) * routed


def test_mixtral_8x7b_is_the_published_size():
    cfg = shape("mixtral_8x7b")
    assert math.isclose(num_params(cfg) / 1e9, 46.7, abs_tol=0.05)
    assert math.isclose(num_params(cfg, active=True) / 1e9, 12.9, abs_tol=0.05)

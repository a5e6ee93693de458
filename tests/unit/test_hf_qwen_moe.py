"""Qwen3-MoE and Qwen2-MoE folders read into the project's MoE decoder and written back
(launcher/models/hf_adapter.py, hf_families.py), in-process: transformers' logits from the
per-expert shards and the fused layout, every part read alone, the export from_pretrained
loads, the folders and exports refused, and Qwen3-30B-A3B's published size. Mixtral's:
tests/unit/test_hf_moe_adapter.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hf_models import TINY_QWEN, qwen_args, tiny_qwen
from parts import check_parts_read_alone

from launcher import models
from launcher.config import ConfigError, num_params
from launcher.launch import cli
from launcher.models import hf_adapter
from launcher.models.moe import routers

CPU = torch.device("cpu")
KINDS = ("qwen3_moe", "qwen2_moe")


def compose(*overrides: str):
    cfg, _, _ = cli.compose_config(["precision=fp32", *overrides])
    return cfg


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{kind: (folder, the transformers model saved there)}: per-expert files, in shards."""
    out = {}
    for kind in KINDS:
        folder = tmp_path_factory.mktemp(kind)
        out[kind] = folder, tiny_qwen(folder, kind)
    return out


def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))


def fused_copy(folder, model, into):
    """The same weights under transformers' own fused names (mlp.experts.gate_up_proj), one file."""
    from safetensors.torch import save_file

    into.mkdir()
    shutil.copy(folder / "config.json", into)
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        into / "model.safetensors",
        metadata={"format": "pt"},
    )
    return into


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", ["per_expert_shards", "fused"])
def test_a_qwen_folder_gives_transformers_logits(saved, tmp_path, kind, layout):
    folder, own = saved[kind]
    names = set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"])
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in names  # the files' per-expert layout
    if layout == "fused":
        folder = fused_copy(folder, own, tmp_path / "fused")
    cfg = compose(*qwen_args(folder, kind))
    hf_adapter.check(cfg)
    gpt = models.build(cfg, CPU).eval()
    x = tokens()
    seen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, i, out: seen.append(out[0])) for _, r in routers(gpt)]
    with torch.no_grad():
        got, want = gpt(x), own(input_ids=x).logits
    for h in hooks:
        h.remove()
    diff = (got - want).abs().max().item()
    assert diff < 1e-5, diff
    assert all(len(set(s.flatten().tolist())) >= 4 for s in seen)  # tokens spread: routing is part of the match
    print(f"{kind} {layout}: max |logit difference| = {diff:.2e} (logits up to {want.abs().max():.2f})")


@pytest.mark.parametrize("kind", KINDS)
def test_each_part_read_alone_is_that_part_of_the_whole(saved, kind):
    """Boxes and flat ranges of every parameter (the per-head norms and the biases included)."""
    cfg = compose(*qwen_args(saved[kind][0], kind))
    whole = dict(models.build(cfg, CPU).named_parameters())
    assert any(n.endswith("q_norm.weight") or n.endswith("wq.bias") for n in whole)
    check_parts_read_alone(hf_adapter.reader(cfg.model), whole, tries=2)


@pytest.mark.parametrize("kind", KINDS)
def test_the_export_is_the_same_model_type_from_pretrained_loads(saved, tmp_path, kind):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from launcher.models.hf_export import save_pretrained

    cfg = compose(*qwen_args(saved[kind][0], kind))
    gpt = models.build(cfg, CPU).eval()
    with torch.no_grad():  # weights the folder does not hold: what a run would have trained
        for p in gpt.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.01)
    state = {k: v.detach().clone() for k, v in gpt.state_dict().items()}
    out = save_pretrained(cfg, state, tmp_path / "hf", torch.float32)
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == kind and written.get("head_dim") == TINY_QWEN[kind].get("head_dim", 16)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "model.layers.1.mlp.experts.7.up_proj.weight" in set(f.keys())
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(loaded).__name__.lower().startswith(kind.replace("_", ""))
    x = tokens()
    with torch.no_grad():
        want, got = gpt(x), loaded(input_ids=x).logits
    diff = (got - want).abs().max().item()
    assert diff < 1e-5, diff
    back = models.build(compose(*qwen_args(out, kind)), CPU)  # and the launcher reads its own export back
    assert all(torch.equal(back.state_dict()[k], v) for k, v in state.items())
    print(f"{kind} export: from_pretrained's max |logit difference| = {diff:.2e}")


@pytest.mark.parametrize(
    "kind,override,words",
    [
        ("qwen3_moe", "model.head_dim=null", ["model.head_dim=16", "head_dim=32"]),
        ("qwen3_moe", "model.qk_norm=false", ["model.qk_norm=False", "q_norm, k_norm", "set model.qk_norm=True"]),
        ("qwen3_moe", "model.moe.first_dense=0", ["model.moe.first_dense=0", "mlp_only_layers=1"]),
        ("qwen3_moe", "model.moe.norm_topk=false", ["model.moe.norm_topk=False", "norm_topk_prob=True"]),
        ("qwen3_moe", "model.attn_bias=true", ["model.attn_bias=True", "no q/k/v biases"]),
        ("qwen2_moe", "model.moe.shared_dim=32", ["model.moe.shared_dim=32", "shared_expert_intermediate_size=48"]),
        ("qwen2_moe", "model.moe.shared_gate=false", ["model.moe.shared_gate=False", "shared_expert_gate"]),
        ("qwen2_moe", "model.attn_bias=false", ["model.attn_bias=False", "qkv_bias=True"]),
        ("qwen2_moe", "model.moe.expert_dim=64", ["model.moe.expert_dim=64", "moe_intermediate_size=32"]),
    ],
)
def test_another_shape_is_refused_naming_both_values(saved, kind, override, words):
    with pytest.raises(ConfigError) as e:
        hf_adapter.check_config(compose(*qwen_args(saved[kind][0], kind), override))
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize(
    "kind,change,words",
    [
        ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 64}, ["use_sliding_window=true", "whole window"]),
        ("qwen3_moe", {"mlp_only_layers": [1]}, ["dense blocks [1]", "first model.moe.first_dense"]),
        (
            "qwen3_moe",
            {"decoder_sparse_step": 2, "mlp_only_layers": []},
            ["dense blocks [0, 2]", "decoder_sparse_step=2"],
        ),
        ("qwen3_moe", {"attention_bias": True}, ["attention_bias", "q, k and v only"]),
        (
            "qwen2_moe",
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}},
            ["rope type yarn"],
        ),
    ],
)
def test_a_feature_the_decoder_lacks_is_refused_in_one_line(saved, tmp_path, kind, change, words):
    raw = {**json.loads((saved[kind][0] / "config.json").read_text()), **change}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as e:
        hf_adapter.check_config(compose(*qwen_args(tmp_path, kind)))
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize(
    "overrides,words",
    [
        (["model.qk_norm=true", "model.moe.shared_experts=1"], ["shared experts", "qwen3_moe"]),
        (["model.moe.shared_gate=true"], ["without a shared expert", "qwen2_moe"]),
        (["model.moe.first_dense=1"], ["dense first blocks", "mixtral"]),
        (["model.moe.experts=0", "model.qk_norm=true"], ["q/k norms", "llama"]),
    ],
)
def test_a_decoder_no_model_type_holds_is_not_exported(tmp_path, overrides, words):
    from launcher.models.hf_export import save_pretrained

    cfg = compose("model=moe_tiny", *overrides)
    with pytest.raises(ConfigError) as e:
        save_pretrained(cfg, models.build(cfg, CPU).state_dict(), tmp_path / "hf", torch.float32)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert not (tmp_path / "hf").exists()


def test_qwen3_30b_a3b_is_the_published_size():
    cfg = compose("model=qwen3_30b_a3b")
    meta = sum(p.numel() for p in models.on_meta(cfg).parameters())
    from launcher.planner.memory import ParamCounts

    assert num_params(cfg.model) == ParamCounts.of(cfg.model).total == meta == 30_532_122_624  # its card: 30.5B
    assert 3.3e9 < num_params(cfg.model, active=True) < 3.4e9  # 3,353,032,704; its card: 3.3B

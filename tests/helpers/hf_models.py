"""Tiny Hugging Face models made in the test, from a config (nothing downloaded)."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path


def session_folder(prefix: str) -> Path:
    """A folder made at collection (the bad-input table names its paths), removed when the
    test process ends."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


TINY_LLAMA = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    tie_word_embeddings=False,
    initializer_range=0.02,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def tiny_llama_config(folder: Path, **changes) -> Path:
    """config.json of a 4-layer Llama (hidden 64, 4 heads, 2 KV heads, vocabulary 300)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps({**TINY_LLAMA, **changes}, indent=1))
    return path


def bad_hf_files() -> dict[str, Path]:
    """Config folders for the bad-input table: a good Llama config (but no weights), an
    empty folder, a model type transformers does not have, one that is no causal LM, and
    a GPT-2 (no tensor-parallel or pipeline plan). Made once per test session."""
    root = session_folder("launcher-hf-bad-")
    tiny_llama_config(root / "llama")
    (root / "empty").mkdir()
    for name, fields in {
        "no_such_model": {"model_type": "no_such_model", "hidden_size": 64},
        "t5": {"model_type": "t5", "d_model": 64},
        "gpt2": {
            "model_type": "gpt2",
            "n_embd": 64,
            "n_layer": 2,
            "n_head": 4,
            "vocab_size": 300,
            "n_positions": 256,
            "bos_token_id": 0,
            "eos_token_id": 0,
        },
    }.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(fields))
    return {p.name: p for p in root.iterdir()}


def bad_hf_weights() -> dict[str, Path]:
    """Pretrained folders for the bad-input table, from one tiny Llama saved by
    save_pretrained: `good`, and copies with a tensor missing, an extra tensor, a tensor
    of the wrong shape, and the weights file cut short. Made once per test session."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    root = session_folder("launcher-hf-weights-")
    fields = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    AutoModelForCausalLM.from_config(LlamaConfig(**fields)).save_pretrained(root / "good")
    good = load_file(root / "good" / "model.safetensors")
    changed = {
        "missing": {k: v for k, v in good.items() if k != "model.layers.1.mlp.up_proj.weight"},
        "extra": {**good, "model.layers.0.mlp.extra.weight": torch.zeros(4, 4)},
        "shape": {**good, "model.norm.weight": torch.ones(32)},
    }
    for name, state in changed.items():
        (root / name).mkdir()
        shutil.copy(root / "good" / "config.json", root / name / "config.json")
        save_file(state, root / name / "model.safetensors", metadata={"format": "pt"})
    shutil.copytree(root / "good", root / "truncated")
    file = root / "truncated" / "model.safetensors"
    os.truncate(file, file.stat().st_size - 100)
    return {p.name: p for p in root.iterdir()}


TINY_MIXTRAL = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
"""moe_tiny's shape with 2 layers, 2 KV heads and an untied head (MIXTRAL_ARGS says so)."""


def mixtral_args(folder: Path) -> list[str]:
    """The launcher's overrides for the project's decoder of TINY_MIXTRAL's shape, read from `folder`."""
    return [
        "model=moe_tiny",
        "model.n_layers=2",
        "model.n_kv_heads=2",
        "model.tie_embeddings=false",
        f"model.pretrained={folder}",
    ]


def tiny_mixtral(folder: Path, seed: int = 0, shard: str | None = "200KB", **changes):
    """A tiny Mixtral made with transformers and saved with save_pretrained (several shards
    and their index unless shard is None): its routers drawn wider than transformers' init
    (std 0.5), so that tokens spread over the experts and routing decides. Returns the model."""
    import torch
    from transformers import AutoModelForCausalLM, MixtralConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(MixtralConfig(**{**TINY_MIXTRAL, **changes})).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return model


def bad_moe_folders() -> dict[str, Path]:
    """config.json-only folders for the bad-input table: a Mixtral of 4 experts (moe_tiny has
    8), a Qwen3-MoE with a sliding window (which the decoder lacks) and a Qwen2-MoE of
    TINY_MIXTRAL's shape, whose q/k/v biases the Mixtral shape has not."""
    root = session_folder("launcher-moe-bad-")
    configs = {
        "mixtral_4_experts": {"model_type": "mixtral", **TINY_MIXTRAL, "num_local_experts": 4},
        "qwen3_moe": {"model_type": "qwen3_moe", **TINY_MIXTRAL, "use_sliding_window": True, "sliding_window": 64},
        "qwen2_moe": {"model_type": "qwen2_moe", **TINY_MIXTRAL, "moe_intermediate_size": 128, "norm_topk_prob": True},
    }
    for name, fields in configs.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(fields))
    return {p.name: p for p in root.iterdir()}


TINY_QWEN = {
    "qwen3_moe": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[0],
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    ),
    "qwen2_moe": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=False,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    ),
}
"""A Qwen3-MoE (head_dim 32 apart from 64 / 4, q/k norms, top-2 renormalized, a dense first block)
and a Qwen2-MoE (q/k/v biases, a gated shared expert of width 48, top-2 not renormalized)."""


def qwen_args(folder: Path, kind: str) -> list[str]:
    """The launcher's overrides for the project's decoder of TINY_QWEN[kind]'s shape, read from `folder`."""
    common = [
        "model=moe_tiny",
        "model.dim=64",
        "model.n_heads=4",
        "model.n_kv_heads=2",
        "model.ffn_dim=96",
        "model.moe.expert_dim=32",
        "model.norm_eps=1e-6",
        "model.tie_embeddings=false",
        f"model.pretrained={folder}",
    ]
    if kind == "qwen3_moe":
        return common + ["model.n_layers=3", "model.head_dim=32", "model.qk_norm=true", "model.moe.first_dense=1"]
    return common + [
        "model.n_layers=2",
        "model.attn_bias=true",
        "model.moe.shared_experts=1",
        "model.moe.shared_dim=48",
        "model.moe.shared_gate=true",
        "model.moe.norm_topk=false",
    ]


def tiny_qwen(folder: Path, kind: str, seed: int = 0, shard: str | None = "100KB", **changes):
    """A tiny Qwen3-MoE or Qwen2-MoE made with transformers and saved with save_pretrained (in
    shards unless shard is None). What transformers' init leaves at 1 or 0 (q/k norms, biases)
    is drawn, so that a permutation or a missing term shows; the routers drawn wide (std 0.5)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(kind, **{**TINY_QWEN[kind], **changes})
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1 + 0.5 * torch.randn_like(p))
            elif name.endswith(".bias") or "shared_expert_gate" in name:
                p.normal_(0, 0.5)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return model

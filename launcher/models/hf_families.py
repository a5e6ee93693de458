"""The Hugging Face model types the project's decoder reads and writes (launcher/models/hf_adapter.py):
each one's config.json against the decoder's fields, what it has that the decoder lacks, its
tensor names where they differ, and the config the export writes. Launch side: no torch.

    mixtral     softmax top-k renormalized, every block routed, no shared expert; w1/w3/w2 experts
    qwen3_moe   + head_dim apart from dim / n_heads, q/k RMSNorm per head (model.qk_norm),
                norm_topk_prob (model.moe.norm_topk), dense first blocks (mlp_only_layers ->
                model.moe.first_dense); gate_proj/up_proj/down_proj experts
    qwen2_moe   + q/k/v biases (qkv_bias -> model.attn_bias), a shared expert of its own width
                (shared_expert_intermediate_size -> model.moe.shared_dim) scaled by
                sigmoid(shared_expert_gate x) (model.moe.shared_gate)
    llama, mistral  a dense decoder
"""

from __future__ import annotations

from launcher.config import ConfigError, ModelConfig, MoEBalance, MoEScore, expert_dim, ffn_dim, head_dim, shared_dim

QWEN = ("qwen3_moe", "qwen2_moe")
TYPES = ("mixtral", *QWEN, "llama", "mistral")
EXAMPLES = "model=mixtral_8x7b, model=qwen3_30b_a3b"
"""conf/model files of a Hugging Face model's shape."""


def experts_of(raw: dict) -> int:
    return raw.get("num_local_experts") or raw.get("num_experts") or 0


def dense_layers(raw: dict) -> list[int]:
    """Qwen: the blocks whose feed-forward is dense (mlp_only_layers, decoder_sparse_step)."""
    step, only = raw.get("decoder_sparse_step") or 1, set(raw.get("mlp_only_layers") or [])
    return [i for i in range(raw.get("num_hidden_layers") or 0) if i in only or (i + 1) % step]


def family_fields(m: ModelConfig, raw: dict, kind) -> list[tuple[str, object, str, object]]:
    """pairs' fields that depend on the family: q/k norms and biases, Qwen's expert and dense
    widths, Qwen2-MoE's gated shared expert."""
    e, moe = m.moe, m.moe.experts > 0
    fields: list[tuple[str, object, str, object]] = []
    qwen2, qwen3 = kind == "qwen2_moe", kind == "qwen3_moe"
    fields.append(
        ("model.qk_norm", m.qk_norm, f"model_type={kind} ({'q_norm, k_norm' if qwen3 else 'no q/k norms'})", qwen3)
    )
    if kind in QWEN:
        dense = dense_layers(raw)
        fields += [
            ("model.moe.expert_dim", expert_dim(m), "moe_intermediate_size", raw.get("moe_intermediate_size")),
            ("model.moe.norm_topk", e.norm_topk, "norm_topk_prob", bool(raw.get("norm_topk_prob", False))),
            ("model.moe.first_dense", e.first_dense, "mlp_only_layers", len(dense)),
        ]
        if dense:
            fields.append(("model.ffn_dim", ffn_dim(m), "intermediate_size", raw.get("intermediate_size")))
    else:
        fields.append(
            (
                "model.moe.expert_dim" if moe else "model.ffn_dim",
                expert_dim(m) if moe else ffn_dim(m),
                "intermediate_size",
                raw.get("intermediate_size"),
            )
        )
    fields.append(
        (
            "model.attn_bias",
            m.attn_bias,
            "qkv_bias" if qwen2 else f"model_type={kind} (no q/k/v biases)",
            bool(raw.get("qkv_bias", True)) if qwen2 else False,
        )
    )
    if moe and qwen2:
        fields += [
            ("model.moe.shared_experts", min(e.shared_experts, 1), "model_type=qwen2_moe (a shared expert)", 1),
            (
                "model.moe.shared_dim",
                shared_dim(m),
                "shared_expert_intermediate_size",
                raw.get("shared_expert_intermediate_size"),
            ),
            ("model.moe.shared_gate", e.shared_gate, "model_type=qwen2_moe (shared_expert_gate)", True),
        ]
    return fields


def pairs(m: ModelConfig, raw: dict) -> list[tuple[str, object, str, object]]:
    """(project key, its value, the folder's field as it reads, the value the key must take)."""
    kind, e, moe = raw.get("model_type"), m.moe, m.moe.experts > 0
    heads = raw.get("num_attention_heads")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", raw.get("rope_theta", 1e4)))
    hd = raw.get("head_dim") or (raw.get("hidden_size") or 0) // (heads or 1)
    fields: list[tuple[str, object, str, object]] = [
        ("model.vocab_size", m.vocab_size, "vocab_size", raw.get("vocab_size")),
        ("model.dim", m.dim, "hidden_size", raw.get("hidden_size")),
        ("model.n_layers", m.n_layers, "num_hidden_layers", raw.get("num_hidden_layers")),
        ("model.n_heads", m.n_heads, "num_attention_heads", heads),
        ("model.n_kv_heads", m.n_kv_heads or m.n_heads, "num_key_value_heads", raw.get("num_key_value_heads") or heads),
        ("model.head_dim", head_dim(m), "head_dim", hd),
        (
            "model.moe.experts",
            e.experts,
            "num_experts" if "num_experts" in raw else "num_local_experts",
            experts_of(raw),
        ),
        ("model.rope_theta", m.rope_theta, "rope_theta", theta),
        ("model.norm_eps", m.norm_eps, "rms_norm_eps", raw.get("rms_norm_eps")),
        ("model.tie_embeddings", m.tie_embeddings, "tie_word_embeddings", bool(raw.get("tie_word_embeddings"))),
    ]
    if moe:
        fields.append(("model.moe.top_k", e.top_k, "num_experts_per_tok", raw.get("num_experts_per_tok")))
    fields += family_fields(m, raw, kind)
    return [
        (key, value, f"{theirs}={want}" if "=" not in theirs else theirs, want) for key, value, theirs, want in fields
    ]


def problems(raw: dict, seq_len: int, max_seq_len: int) -> list[tuple[bool, str]]:
    """(whether the folder has it, what) for each feature the decoder lacks."""
    kind = raw.get("model_type")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    qwen = kind in QWEN
    window = raw.get("sliding_window") if not qwen or raw.get("use_sliding_window") else None
    dense = dense_layers(raw) if qwen else []
    return [
        (raw.get("hidden_act", "silu") != "silu", f"hidden_act={raw.get('hidden_act')} (the decoder: silu)"),
        (rope_type != "default", f"rope type {rope_type} (the decoder: default rotary)"),
        (
            bool(raw.get("attention_bias") or raw.get("mlp_bias")),
            "attention_bias/mlp_bias (the decoder biases q, k and v only: model.attn_bias)",
        ),
        (
            qwen and bool(raw.get("use_sliding_window")),
            f"use_sliding_window=true (sliding_window="
            f"{raw.get('sliding_window')}; the decoder attends to the whole window)",
        ),
        (
            (window or seq_len) < seq_len,
            f"sliding_window={window} below train.seq_len={seq_len} (the decoder attends to the whole window)",
        ),
        (
            dense != list(range(len(dense))),
            f"dense blocks {dense} (mlp_only_layers={raw.get('mlp_only_layers')}, "
            f"decoder_sparse_step={raw.get('decoder_sparse_step')}): the decoder's dense blocks are the first "
            "model.moe.first_dense",
        ),
        (
            bool(raw.get("router_jitter_noise")),
            f"router_jitter_noise={raw.get('router_jitter_noise')} (the decoder's router has no noise)",
        ),
        (
            (raw.get("max_position_embeddings") or max_seq_len) < max_seq_len,
            f"max_position_embeddings={raw.get('max_position_embeddings')} below model.max_seq_len={max_seq_len}",
        ),
    ]


def router_wants(kind: str, m: ModelConfig) -> list[tuple[str, object, object]]:
    """(key, its value, the value this model type routes with): what config.json does not name."""
    e = m.moe
    wants: list[tuple[str, object, object]] = [
        ("model.moe.score", e.score.value, MoEScore.softmax.value),
        ("model.moe.route_scale", e.route_scale, 1.0),
    ]
    if kind == "mixtral":
        wants += [("model.moe.norm_topk", e.norm_topk, True), ("model.moe.first_dense", e.first_dense, 0)]
    if kind != "qwen2_moe":
        wants += [("model.moe.shared_experts", e.shared_experts, 0), ("model.moe.shared_gate", e.shared_gate, False)]
    return wants


# ----------------------------------------------------------------------------- export
def export_type(m: ModelConfig) -> str:
    """The model type the decoder is written as; ConfigError (export.format=hf) when none holds it."""
    e = m.moe
    if not e.experts:
        kind, why = "llama", [(not m.qk_norm, "q/k norms (model.qk_norm)"), (not m.attn_bias, "attention biases")]
    else:
        kind = "qwen3_moe" if m.qk_norm else "qwen2_moe" if e.shared_gate or m.attn_bias else "mixtral"
        why = [
            (e.score == MoEScore.softmax, f"score={e.score.value}"),
            (e.route_scale == 1.0, f"route_scale={e.route_scale}"),
            (e.balance != MoEBalance.bias, "balance=bias's biases"),
            (e.top_k > 1 or not e.norm_topk, "top_k=1 renormalized (transformers: weight 1, the decoder: its score)"),
        ]
        why += {
            "mixtral": [
                (e.norm_topk, "norm_topk=false"),
                (e.shared_experts == 0, "shared experts without moe.shared_gate"),
                (e.first_dense == 0, "dense first blocks"),
            ],
            "qwen3_moe": [(e.shared_experts == 0, "shared experts"), (not m.attn_bias, "attention biases")],
            "qwen2_moe": [(e.shared_experts > 0 and e.shared_gate, "biases or a shared gate without a shared expert")],
        }[kind]
    for ok, what in why:
        if not ok:
            raise ConfigError(
                "export.format",
                "hf",
                f"the decoder has {what}, which {kind}'s layout (the closest "
                f"transformers model) has not; export.format=safetensors",
            )
    return kind


def hf_config(m: ModelConfig):
    """The transformers config of the export (export_type's model)."""
    from transformers import AutoConfig  # local: optional (transformers, after offline())

    kind, e = export_type(m), m.moe
    fields = dict(
        vocab_size=m.vocab_size,
        hidden_size=m.dim,
        num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads,
        num_key_value_heads=m.n_kv_heads or m.n_heads,
        head_dim=head_dim(m),
        max_position_embeddings=m.max_seq_len,
        rms_norm_eps=m.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
        tie_word_embeddings=m.tie_embeddings,
        hidden_act="silu",
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if kind == "llama":
        fields |= dict(intermediate_size=ffn_dim(m), attention_bias=False, mlp_bias=False)
    elif kind == "mixtral":
        fields |= dict(
            intermediate_size=expert_dim(m),
            num_local_experts=e.experts,
            num_experts_per_tok=e.top_k,
            router_aux_loss_coef=e.aux_loss_coef,
            router_jitter_noise=0.0,
            sliding_window=None,
        )
    else:
        fields |= dict(
            intermediate_size=ffn_dim(m),
            moe_intermediate_size=expert_dim(m),
            num_experts=e.experts,
            num_experts_per_tok=e.top_k,
            norm_topk_prob=e.norm_topk,
            router_aux_loss_coef=e.aux_loss_coef,
            decoder_sparse_step=1,
            mlp_only_layers=list(range(e.first_dense)),
            use_sliding_window=False,
        )
        fields |= (
            dict(qkv_bias=m.attn_bias, shared_expert_intermediate_size=shared_dim(m))
            if kind == "qwen2_moe"
            else dict(attention_bias=False)
        )
    return AutoConfig.for_model(kind, **fields)

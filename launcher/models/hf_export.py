"""The trained weights as a Hugging Face folder (`make export RUN=... export.format=hf`):
a model=hf run as its own model type, the project's decoder as LlamaForCausalLM (the same
architecture under Llama's names, its rotary rows permuted to Llama's layout).
"""

from __future__ import annotations

from pathlib import Path

import torch

from launcher import offline
from launcher.config import Config, ModelConfig, ModelKind, ffn_dim
from launcher.models.hf import hf_config


def save_pretrained(cfg: Config, state: dict[str, torch.Tensor], out: Path, dtype: torch.dtype) -> Path:
    """A folder AutoModelForCausalLM.from_pretrained loads: config.json, safetensors
    shards, generation_config.json, and the tokenizer when the run's data named a local
    tokenizer folder. `state`: consolidated full weights under this model's names."""
    offline()
    from transformers import AutoModelForCausalLM, GenerationConfig

    if cfg.model.kind == ModelKind.hf:
        config = hf_config(cfg.model)
    else:
        config, state = llama_from_gpt(cfg.model, state)
    with torch.device("meta"):  # names and shapes only: the weights are `state`
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    if config.tie_word_embeddings:  # assign gave the head its own tensor: tie it again
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    model.config.dtype = dtype
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    if model.can_generate() and not (out / "generation_config.json").exists():
        GenerationConfig.from_model_config(model.config).save_pretrained(out)
    tokenizer = getattr(cfg.data, "tokenizer", None)  # data=hf_text's local tokenizer folder, when there is one
    if tokenizer and Path(tokenizer).is_dir():
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer, local_files_only=True, trust_remote_code=False).save_pretrained(out)
    return out


def llama_from_gpt(m: ModelConfig, state: dict[str, torch.Tensor]):
    """The project's decoder as LlamaForCausalLM: the same architecture (RMSNorm, rotary,
    SwiGLU, optional tying, no biases) under Llama's names. Only the rotary layout
    differs: gpt.py rotates adjacent channel pairs (2i, 2i+1), Llama rotates halves
    (i, i + head_dim/2); q and k rows are permuted per head to match (the same permutation
    transformers' convert_llama_weights_to_hf applies)."""
    offline()
    from transformers import LlamaConfig

    head_dim = m.dim // m.n_heads
    kv = m.n_kv_heads or m.n_heads
    config = LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.dim, intermediate_size=ffn_dim(m),
                         num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads, num_key_value_heads=kv,
                         head_dim=head_dim, max_position_embeddings=m.max_seq_len, rms_norm_eps=m.norm_eps,
                         rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
                         tie_word_embeddings=m.tie_embeddings, attention_bias=False, mlp_bias=False,
                         hidden_act="silu", bos_token_id=None, eos_token_id=None, pad_token_id=None)

    def halves(w: torch.Tensor, heads: int) -> torch.Tensor:
        return w.view(heads, head_dim // 2, 2, m.dim).transpose(1, 2).reshape(heads * head_dim, m.dim)

    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    per_layer = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
                 "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
                 "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
                 "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
                 "ffn_norm": "post_attention_layernorm"}
    out = {}
    for key, value in state.items():
        if key in names:
            out[names[key]] = value
            continue
        _, i, rest = key.split(".", 2)
        part = rest.removesuffix(".weight")
        if part == "attention.wq":
            value = halves(value, m.n_heads)
        elif part == "attention.wk":
            value = halves(value, kv)
        out[f"model.layers.{i}.{per_layer[part]}.weight"] = value
    return config, out

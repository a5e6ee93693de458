"""Tiny Hugging Face models made in the test, from a config (nothing downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

TINY_LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=300, hidden_size=64,
                  intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False,
                  initializer_range=0.02, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def tiny_llama_config(folder: Path, **changes) -> Path:
    """config.json of a 4-layer Llama (hidden 64, 4 heads, 2 KV heads, vocabulary 300)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps({**TINY_LLAMA, **changes}, indent=1))
    return path

"""The trained weights as a Hugging Face folder (`make export RUN=... export.format=hf`):
a model=hf run as its own model type, the project's decoder as LlamaForCausalLM, or with
model.moe as MixtralForCausalLM (the same architecture under their names, the rotary rows
permuted to their layout: launcher/models/hf_adapter.py, which also reads such folders back).
"""

from __future__ import annotations

from pathlib import Path

import torch

from launcher import offline
from launcher.config import Config, ModelKind
from launcher.models.hf import hf_config
from launcher.models.hf_adapter import to_hf


def save_pretrained(cfg: Config, state: dict[str, torch.Tensor], out: Path, dtype: torch.dtype) -> Path:
    """A folder AutoModelForCausalLM.from_pretrained loads: config.json, safetensors
    shards, generation_config.json, and the tokenizer when the run's data named a local
    tokenizer folder. `state`: consolidated full weights under this model's names."""
    offline()
    from transformers import AutoModelForCausalLM, GenerationConfig  # local: optional (transformers, after offline())

    if cfg.model.kind == ModelKind.hf:
        config = hf_config(cfg.model)
    else:
        config, state = to_hf(cfg.model, state)
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
        from transformers import AutoTokenizer  # local: optional (transformers, after offline())

        AutoTokenizer.from_pretrained(tokenizer, local_files_only=True, trust_remote_code=False).save_pretrained(out)
    return out

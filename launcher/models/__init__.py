"""The models the launcher trains, behind the few facts the recipes need.

Two kinds (`model.kind`): the project's decoder (gpt.py) and a Hugging Face causal LM
(hf.py, model=hf). Both take token batches and return logits, or the mean loss given
targets; the recipes find their parts by name through a `Layout` (which modules are the
decoder layers, the embedding, the final norm, the head; which matmuls tensor parallel
splits). Functions here dispatch on the kind; transformers is imported only for model=hf.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from launcher.config import Config, ModelKind


@dataclass(frozen=True)
class Layout:
    """Where a decoder's parts are, by module name (the full model's names, which every
    shard, stage and checkpoint keeps)."""

    embed: str = "tok_embeddings"
    layers: str = "layers"
    """The nn.ModuleList of decoder layers: FSDP wraps each, pipeline stages cut between them."""
    norm: str = "norm"
    head: str = "output"
    tied: bool = True
    """The head's weight is the embedding's (one Parameter)."""
    colwise: tuple[str, ...] = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
    """Inside a layer: matmuls tensor parallel splits by output columns (whole heads per rank)."""
    rowwise: tuple[str, ...] = ("attention.wo", "feed_forward.w2")
    """Inside a layer: matmuls split by input rows (partial sums all-reduced)."""
    norms: tuple[str, ...] = ("attention_norm", "ffn_norm")
    """Inside a layer: modules computed whole on every tensor-parallel rank."""
    attention: str = "attention"
    mlp: str = "feed_forward"

    def tied_names(self) -> tuple[str, str] | None:
        """(head weight, embedding weight) when tied: checkpoints keep the embedding's name."""
        return (f"{self.head}.weight", f"{self.embed}.weight") if self.tied else None


def layout(cfg: Config) -> Layout:
    if cfg.model.kind == ModelKind.hf:
        from launcher.models import hf

        return hf.layout(cfg.model)
    return Layout(tied=cfg.model.tie_embeddings)


def model_layout(model: nn.Module) -> Layout:
    """The layout of a built model (the project's decoder has no attribute: the default names)."""
    return getattr(model, "layout", None) or Layout(tied=model.cfg.tie_embeddings)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.get_submodule(model_layout(model).layers)


def build(cfg: Config, device: torch.device) -> nn.Module:
    """The model on `device`, initialised from the RNG state the caller seeded (the same
    on every rank), or from model.pretrained's weights."""
    if cfg.model.kind == ModelKind.hf:
        from launcher.models import hf

        return hf.build(cfg.model, device)
    from launcher.models.gpt import GPT

    with torch.device(device):
        return GPT(cfg.model)


def on_meta(cfg: Config) -> nn.Module:
    """The model's structure on the meta device: names and shapes, no storage."""
    if cfg.model.kind == ModelKind.hf:
        from launcher.models import hf

        return hf.build(cfg.model, torch.device("meta"), weights=False)
    return build(cfg, torch.device("meta"))


def set_activation_checkpointing(model: nn.Module, cfg: Config) -> None:
    t = cfg.train
    if cfg.model.kind == ModelKind.hf:
        from launcher.models import hf

        return hf.set_activation_checkpointing(model, t.activation_checkpointing, t.ac_every)
    from launcher.models.gpt import set_activation_checkpointing as gpt_ac

    gpt_ac(model, t.activation_checkpointing, t.ac_every)


def flops_per_token(cfg: Config, seq_len: int) -> float:
    """Training FLOPs per token for MFU (see launcher.models.gpt.flops_per_token)."""
    from launcher.models.gpt import flops_per_token as gpt_flops

    if cfg.model.kind == ModelKind.hf:
        from launcher.models import hf

        return hf.flops_per_token(cfg.model, seq_len)
    return gpt_flops(cfg.model, seq_len)

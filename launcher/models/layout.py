"""Where a decoder's parts are, by module name: what the recipes find the parts of either
kind of model by (launcher.models.layout(cfg) gives a model's)."""

from __future__ import annotations

from dataclasses import dataclass


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

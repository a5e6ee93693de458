"""The models the launcher trains, behind the few facts the recipes need.

Two kinds (`model.kind`): the project's decoder (gpt.py) and a Hugging Face causal LM
(hf.py, model=hf). Both take token batches and return logits, or the mean loss given
targets; the recipes find their parts by name through a `Layout` (which modules are the
decoder layers, the embedding, the final norm, the head; which matmuls tensor parallel
splits). The functions (dispatch.py, re-exported here) dispatch on the kind; transformers is imported only for model=hf,
and torch only by the functions that build or change a model: the launch side reads the
project's decoder's shape (`model_shape`, `model_vocab_size`) without either.
"""

from launcher.models.dispatch import (
    after_step,
    build,
    cast_params,
    decoder_layers,
    flops_per_token,
    init_buffers,
    init_specs,
    layout,
    materialize,
    model_layout,
    model_shape,
    model_vocab_size,
    offloaded,
    on_meta,
    prepare,
    set_activation_checkpointing,
    skeleton,
)
from launcher.models.layout import Layout

__all__ = [
    "Layout",
    "after_step",
    "build",
    "cast_params",
    "decoder_layers",
    "flops_per_token",
    "init_buffers",
    "init_specs",
    "layout",
    "materialize",
    "model_layout",
    "model_shape",
    "model_vocab_size",
    "offloaded",
    "on_meta",
    "prepare",
    "set_activation_checkpointing",
    "skeleton",
]

"""Optimizer state in the plan: launcher.optim's bytes per tensor over the tensors that train
(every parameter, or model.lora's adapters), as each rank holds them."""

from __future__ import annotations

import functools
import math

from launcher import optim as O
from launcher.config import Config, ModelConfig, from_shape_key, shape_key
from launcher.planner import lora
from launcher.planner import memory as M


def optimizer_states(cfg: Config, P: int, n: int) -> int:
    """Bytes of optimizer state for P parameters (a rank's share before data-parallel
    sharding) split over n ranks: launcher.optim.state_bytes (optim.name's family). adamw:
    8 bytes a parameter. The others depend on each tensor's shape and shard (torchao
    quantizes a shard of at least 4096 elements, Adafactor keeps whole rows and columns,
    Muon takes the hidden matrices): the model's trainable tensors each as FSDP2 holds
    it on the rank with the most (ceil(rows / n) rows), scaled from the whole model to P
    (tensor-parallel and pipeline shares take the whole model's mix of tensors)."""
    if cfg.optim.name == "adamw":
        return 8 * P // n
    tensors = trainable_tensors(cfg.model)
    held = [O.Trainable(shape, -(-shape[0] // n) * math.prod(shape[1:]), embedding) for shape, embedding in tensors]
    return round(O.state_bytes(cfg.optim, held) * P / sum(math.prod(shape) for shape, _ in tensors))


def trainable_tensors(m: ModelConfig) -> tuple[tuple[tuple[int, ...], bool], ...]:
    """(shape, is the embedding or the head) of each trainable parameter of the model (all of
    them: a tied head is the embedding's; model.lora: the adapters)."""
    if lora.enabled(m):  # the adapters: A (r x in) and B (out x r) of each targeted projection
        return lora.adapter_tensors(m)
    return _trainable(shape_key(m))


@functools.lru_cache(maxsize=32)
def _trainable(key: tuple) -> tuple[tuple[tuple[int, ...], bool], ...]:
    model = M._meta_gpt(from_shape_key(key))
    return tuple(
        (tuple(p.shape), name.startswith(("tok_embeddings.", "output."))) for name, p in model.named_parameters()
    )

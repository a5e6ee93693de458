"""Figures derived from a config alone, shared by the launch side and the ranks: the FFN
width, the decoder's parameter counts, the learning-rate schedule, the pipeline's stage
count, the processes per node. The degrees and the batch arithmetic need the recipe's
engine (what it may split): launcher/parallel/degrees.py.
"""

from __future__ import annotations

import math

from launcher.config.enums import ModelKind, PPSchedule
from launcher.config.model import ModelConfig, MoEConfig
from launcher.config.moe import moe_key
from launcher.config.recipe import ParallelConfig
from launcher.config.root import Config
from launcher.config.train import OptimConfig

LOSS_CHUNK_BYTES = 256 * 2**20  # train.loss_chunks=null: one slice's fp32 logits at most this


def ffn_dim(m: ModelConfig) -> int:
    if m.ffn_dim is not None:
        return m.ffn_dim
    hidden = int(8 * m.dim / 3)
    return m.multiple_of * ((hidden + m.multiple_of - 1) // m.multiple_of)


def expert_dim(m: ModelConfig) -> int:
    """An expert's SwiGLU hidden size (model.moe.expert_dim, else the dense ffn_dim)."""
    return m.moe.expert_dim or ffn_dim(m)


def is_moe_block(m: ModelConfig, i: int) -> bool:
    """Whether block i's feed-forward is a mixture of experts (model.moe)."""
    return m.moe.experts > 0 and i >= m.moe.first_dense


def head_dim(m: ModelConfig) -> int:
    """Each attention head's width (model.head_dim, else dim / n_heads)."""
    return m.head_dim or m.dim // m.n_heads


def shared_dim(m: ModelConfig) -> int:
    """The MoE shared expert's SwiGLU hidden size (0: none)."""
    e = m.moe
    return 0 if not e.shared_experts else e.shared_dim or e.shared_experts * expert_dim(m)


def attention_params(cfg: ModelConfig) -> int:
    """q, k, v, o matmul weights (biases and q/k norms: attention_extra_params)."""
    q, kv = cfg.n_heads * head_dim(cfg), (cfg.n_kv_heads or cfg.n_heads) * head_dim(cfg)
    return cfg.dim * q * 2 + cfg.dim * kv * 2


def attention_extra_params(cfg: ModelConfig) -> int:
    """A block's attention parameters outside its matmuls: q/k/v biases, the q and k norms."""
    q, kv = cfg.n_heads * head_dim(cfg), (cfg.n_kv_heads or cfg.n_heads) * head_dim(cfg)
    return (q + 2 * kv if cfg.attn_bias else 0) + (2 * head_dim(cfg) if cfg.qk_norm else 0)


def ffn_params(m: ModelConfig, i: int, active: bool = False) -> int:
    """Block i's feed-forward matmul weights: dense SwiGLU, or the router, the routed experts
    (all E, or the top k a token runs when `active`), the shared one and its gate."""
    if not is_moe_block(m, i):
        return 3 * m.dim * ffn_dim(m)
    e = m.moe
    routed = (e.top_k if active else e.experts) * 3 * m.dim * expert_dim(m)
    gate = m.dim if e.shared_gate and e.shared_experts else 0
    return m.dim * e.experts + routed + 3 * m.dim * shared_dim(m) + gate


def block_matmul_params(cfg: ModelConfig, i: int = 0, active: bool = False) -> int:
    """Matmul weights of block i: q, k, v, o and the feed-forward's (ffn_params)."""
    return attention_params(cfg) + ffn_params(cfg, i, active)


def matmul_params(cfg: ModelConfig, active: bool = True) -> int:
    """Every block's matmul weights and the head's; an MoE counts the experts a token runs
    (its FLOPs), or all of them with active=False."""
    return sum(block_matmul_params(cfg, i, active) for i in range(cfg.n_layers)) + cfg.dim * cfg.vocab_size


def num_params(cfg: ModelConfig, active: bool = False) -> int:
    """Parameter count from the config alone (matches GPT(cfg).num_params()); `active`: the
    parameters one token runs through (an MoE's top k experts of E)."""
    embed = cfg.vocab_size * cfg.dim
    norms = cfg.dim * (2 * cfg.n_layers + 1) + cfg.n_layers * attention_extra_params(cfg)
    untied_head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
    return matmul_params(cfg, active) - cfg.dim * cfg.vocab_size + embed + untied_head + norms


def lr_factor(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Linear warm-up over warmup_steps, then cosine from 1 down to min_lr_ratio.
    `step` counts optimizer steps already taken (0 for the first)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def held_out_windows(windows: int, fraction: float) -> int:
    """data.val_fraction: how many of a token file's `windows` (its last ones) validation
    holds out of training; the launch side's check and the ranks' TokenFile both count so."""
    return math.ceil(windows * fraction - 1e-9)  # not 4 of 30 x 0.1 by float error


def pipeline_stages(p: ParallelConfig) -> int:
    """Pipeline stages in all: pp, times the stages per rank of an interleaved schedule."""
    return p.pp * (p.pp_virtual_stages if p.pp_schedule == PPSchedule["interleaved_1f1b"] else 1)


def nproc_per_node(cfg: Config, host) -> int:
    c = cfg.cluster
    if c.nproc_per_node is not None:
        return c.nproc_per_node
    if c.gpus_per_node is not None:
        return c.gpus_per_node
    return host.gpus if host.cuda else 2


def loss_chunks(cfg: Config, vocab_size: int, micro_batch: int, sliceable: bool) -> int:
    """Slices of the sequence the loss is computed over: train.loss_chunks, or (null) the
    fewest, a power of two, that keep one slice's fp32 logits within LOSS_CHUNK_BYTES; 1
    where the layout cannot slice it (`sliceable` false: model=hf, a pipeline's last stage,
    tensor parallel; launch/checks/validate.py refuses an explicit N > 1 there)."""
    if cfg.train.loss_chunks is not None:
        return cfg.train.loss_chunks
    s, chunks = cfg.train.seq_len, 1
    while sliceable and 4 * micro_batch * math.ceil(s / chunks) * vocab_size > LOSS_CHUNK_BYTES and chunks < s:
        chunks *= 2
    return min(chunks, s)


def sliceable_loss(cfg: Config, pp: int, tp: int) -> bool:
    """Whether the loss can be sliced (train.loss_chunks) under these degrees."""
    return cfg.model.kind != ModelKind.hf and pp == 1 and tp == 1


def shape_key(m: ModelConfig) -> tuple:
    """A decoder's shape fields as a hashable key (caches of counts by shape); the adapters
    (model.lora) are not part of the shape."""
    return tuple(sorted((k, moe_key(v) if k == "moe" else v) for k, v in vars(m).items() if k != "lora"))


def from_shape_key(key: tuple) -> ModelConfig:
    """The ModelConfig a shape_key was made from (adapters off)."""
    fields = dict(key)
    if "moe" in fields:
        fields["moe"] = MoEConfig(**dict(fields["moe"]))
    return ModelConfig(**fields)

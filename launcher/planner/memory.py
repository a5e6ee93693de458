"""The model of memory: what one rank holds during a training step, term by term.

docs/memory.md derives every formula here; the names of the functions and terms match
the sections there. Everything is bytes, per rank, for the project's decoder
(launcher/models/gpt.py): Ψ parameters, micro-batch b, sequence s, hidden h, heads a,
key/value width h_kv, SwiGLU width f, vocabulary V, L layers.

`ActivationCounter` (launcher/planner/counter.py) measures the same quantity on a real step with
torch.autograd.graph.saved_tensors_hooks, so predictions are checked against what
autograd really keeps.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import nn

from launcher.config import (
    ACMode,
    ModelConfig,
    ModelKind,
    block_matmul_params,
    ffn_dim,
    from_shape_key,
    head_dim,
    is_moe_block,
    num_params,
    shape_key,
)
from launcher.models.gpt import GPT
from launcher.models.init import skip_torch_init


@dataclass(frozen=True)
class Shape:
    """The sizes the formulas use, from a ModelConfig and the batch shape."""

    b: int
    s: int
    h: int
    a: int
    h_kv: int
    h_q: int
    """n_heads x head_dim: h, unless model.head_dim is set apart from dim / n_heads."""
    f: int
    V: int
    L: int
    max_seq: int
    block_params: int
    """Matmul weights of one block (launcher.config.block_matmul_params)."""

    @staticmethod
    def of(m: ModelConfig, micro_batch: int, seq_len: int) -> "Shape":
        head = head_dim(m)
        return Shape(
            b=micro_batch,
            s=seq_len,
            h=m.dim,
            a=m.n_heads,
            h_kv=(m.n_kv_heads or m.n_heads) * head,
            h_q=m.n_heads * head,
            f=ffn_dim(m),
            V=m.vocab_size,
            L=m.n_layers,
            max_seq=m.max_seq_len,
            block_params=block_matmul_params(m),
        )


@dataclass(frozen=True)
class ParamCounts:
    """Parameters by part, counted on a meta-device model: nothing is allocated, so a
    70B configuration is counted in well under a second. (torch's meta device does what
    accelerate.init_empty_weights does, more simply, for a model we construct.)"""

    embed: int
    head: int
    """0 when the head is tied to the embedding."""
    blocks: tuple[int, ...]
    """Each transformer block: its matrices and its two norms (model.moe: dense and MoE blocks differ)."""
    final_norm: int
    experts: tuple[int, ...] = ()
    """Each block's routed experts (model.moe; 0 in a dense block): what parallel.ep splits."""

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    @property
    def block(self) -> int:
        """The largest block."""
        return max(self.blocks)

    @property
    def expert_total(self) -> int:
        return sum(self.experts)

    @property
    def total(self) -> int:
        return self.embed + self.head + sum(self.blocks) + self.final_norm

    @staticmethod
    def of(m: ModelConfig) -> "ParamCounts":
        return _param_counts(shape_key(m))


def _meta_gpt(m: ModelConfig) -> nn.Module:
    """The decoder's structure on the meta device, its init skipped: the first init call on
    meta costs about a second of torch's own set-up, on every launch."""
    with torch.device("meta"), skip_torch_init():
        return GPT(m)


@functools.lru_cache(maxsize=32)
def _param_counts(key: tuple) -> ParamCounts:
    m = from_shape_key(key)
    model = _meta_gpt(m)
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    experts = [getattr(layer.feed_forward, "experts", None) for layer in model.layers]
    return ParamCounts(
        embed=count(model.tok_embeddings),
        head=0 if m.tie_embeddings else count(model.output),
        blocks=tuple(count(layer) for layer in model.layers),
        final_norm=count(model.norm),
        experts=tuple(count(e) if e is not None else 0 for e in experts),
    )


def param_summary(m: ModelConfig) -> dict:
    """What `make plan` shows of the model: its total parameters, the active ones (a token's:
    an MoE's top k experts of E, launcher.config.num_params), and each run of like blocks
    (kind dense or moe, how many, parameters each, of them routed experts)."""
    c, runs = ParamCounts.of(m), list[dict]()
    for i, (block, experts) in enumerate(zip(c.blocks, c.experts)):
        kind = "moe" if is_moe_block(m, i) else "dense"
        if runs and (runs[-1]["kind"], runs[-1]["params"]) == (kind, block):
            runs[-1]["count"] += 1
        else:
            runs.append({"kind": kind, "count": 1, "params": block, "experts": experts})
    return {
        "total": c.total,
        "active": num_params(m, active=True),
        "embed": c.embed,
        "head": c.head,
        "final_norm": c.final_norm,
        "experts": c.expert_total,
        "blocks": runs,
    }


def param_line(m: ModelConfig) -> str:
    """param_summary in one line."""
    p, g = param_summary(m), lambda n: f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"  # noqa: E731
    blocks = ", ".join(
        f"{r['count']} {r['kind']} x {g(r['params'])}"
        + (f" (routed experts {g(r['experts'])})" if r["experts"] else "")
        for r in p["blocks"]
    )
    return f"{m.name}: {g(p['total'])} parameters, {g(p['active'])} active per token; blocks: {blocks}"


# ----------------------------------------------------------------------------- activations
@dataclass(frozen=True)
class Numerics:
    """How a recipe runs the model's arithmetic; it decides what autograd saves.

    autocast: fp32 parameters and residual stream, matmuls in `compute` bytes under
      torch.autocast (ddp, tp, pp). Every matmul saves its own low-precision copy of its
      input (autocast caches only parameter casts) and the weight copies are held.
    low-precision parameters: the module itself is bf16 (DeepSpeed bf16; FSDP2 with a
      bf16 MixedPrecisionPolicy), no autocast: the residual stream is bf16, the norms
      compute in fp32 internally, projections share their input.
    fp32: no autocast, everything 4 bytes, projections share their input.
    """

    compute: int
    """Bytes of the matmul dtype."""
    residual: int
    """Bytes of the residual stream (and of checkpointed block inputs)."""
    autocast: bool
    rope: int = 4
    """Bytes per element of the rotary table (bf16 when the whole module was cast)."""
    gathered_head: bool = False
    """FSDP: the root module's gathered (bf16) head weight stays for backward."""
    gathered_blocks: bool = False
    """FSDP under a pipeline: no block reshards until the step's end, so the gathered
    weights its matmuls save for backward are held once per step, like autocast's copies."""

    @staticmethod
    def of(precision: str, low_precision_params: bool = False, rope_cast: bool = False) -> "Numerics":
        if precision == "fp32":
            return Numerics(compute=4, residual=4, autocast=False)
        if low_precision_params:
            return Numerics(compute=2, residual=2, autocast=False, rope=2 if rope_cast else 4)
        return Numerics(compute=2, residual=4, autocast=True)


def _norm(x: Shape, n: Numerics) -> int:
    """RMSNorm: x.float() -> pow saves the fp32 input (the input itself when it is
    fp32, else a copy), rsqrt its (b, s, 1) result, `* weight` the normalised tensor in
    the input dtype."""
    b, s, h = x.b, x.s, x.h
    return 4 * b * s * h + n.residual * b * s * h + 4 * b * s


def _linear_inputs(x: Shape, n: Numerics, consumers: int) -> int:
    """The norm's output as the projections' input: under autocast each projection casts
    (and saves) its own copy; otherwise they share one tensor."""
    copies = consumers if n.autocast else 1
    width = n.compute if n.autocast else n.residual
    return copies * width * x.b * x.s * x.h


def block_activations(x: Shape, n: Numerics, tp: int = 1, cp: int = 1, sp: bool = False) -> int:
    """Bytes one block saves for backward (no recomputation). tp splits heads and SwiGLU
    width (norms, residual replicated); sp (parallel.sequence_parallel) splits the norms'
    sequence over tp too (Korthikanti et al. 2022, section 4.2.2; launcher/parallel/cuts.py),
    while the projections save the gathered, whole sequence (PrepareModuleInput to
    Replicate: Megatron's saving of the sharded input is not made); cp: x.s is this rank's
    positions (context.py)."""
    b, s, c = x.b, x.s, n.compute
    h_q, h_kv, heads, f = x.h_q // tp, x.h_kv // tp, x.a // tp, x.f // tp
    # q, k, v, out; fp32 logsumexp. GQA saves the repeated (full-width) k and v.
    sdpa = c * b * s * (2 * h_q + 2 * max(h_kv, h_q)) + 4 * b * heads * s
    mlp = 4 * c * b * s * f  # w1 out, w3 out, silu out, product
    exchanged = c * b * s * h_q if cp > 1 else 0  # context parallel: wo's own input
    norms = 2 * _norm(x, n) // (tp if sp else 1)
    return norms + _linear_inputs(x, n, 3) + sdpa + exchanged + _linear_inputs(x, n, 2) + mlp


def op_kept(x: Shape, n: Numerics, tp: int = 1) -> int:
    """activation_checkpointing=op: what a block keeps beside its input, the outputs of
    every other matmul (wq, wv before the GQA repeat, w1, w2; wk, wo, w3 run again) and of
    attention (+ fp32 logsumexp); launcher/models/gpt.py::keep_matmuls."""
    h_q, h_kv, f = x.h_q // tp, x.h_kv // tp, x.f // tp
    return n.compute * x.b * x.s * (h_q + h_kv + f + x.h + h_q) + 4 * x.b * (x.a // tp) * x.s


def head_activations(x: Shape, n: Numerics, loss_chunks: int = 1, split: int = 1) -> int:
    """After the last block: final norm, the output matmul's input, the fp32
    log-softmax of the logits, the flat int64 targets. With the loss in slices
    (train.loss_chunks > 1, launcher/models/gpt.py::SlicedLoss): the final norm, and the
    gradients the slices computed in forward: dL/dh in h's dtype and dL/dweight in fp32
    (V x dim: 2.1 GB for Llama 3 8B, against the 4.2 GB fp32 log-softmax of one 8k sequence).
    split: the tensor-parallel degree the final norm's sequence is split over (sequence parallel)."""
    if loss_chunks > 1:
        return _norm(x, n) + n.residual * x.b * x.s * x.h + 4 * x.V * x.h
    return _norm(x, n) // split + _linear_inputs(x, n, 1) + 4 * x.b * x.s * x.V + 8 * x.b * x.s


def loss_temporaries(x: Shape, n: Numerics, loss_chunks: int = 1) -> int:
    """The logits while the loss runs. Whole: 8 bytes a logit, the larger of forward's
    low-precision output and fp32 copy (c + 4) and backward's two fp32 gradients, of the
    log-softmax and of the logits (4 + 4). In slices of m = b x ceil(T / N) positions: one
    slice's fp32 logits and their low-precision copy (none in fp32), plus under autocast
    the low-precision weight and h, made once (measured: tests/unit/test_loss_chunks.py)."""
    if loss_chunks == 1:
        return max(n.compute + 4, 8) * x.b * x.s * x.V
    m = x.b * math.ceil(x.s / loss_chunks)
    once = n.compute * (x.V * x.h + x.b * x.s * x.h) if n.autocast else 0
    return once + 4 * m * x.V + (n.compute * m * x.V if n.compute != 4 else 0)


def token_ids(x: Shape) -> int:
    """The batch of token ids the embedding saves (inputs and targets share it)."""
    return 8 * x.b * (x.s + 1)


def rope_table(x: Shape, n: Numerics) -> int:
    """The rotary table the blocks save slices of: max_seq x head_dim/2 x (cos, sin)."""
    return n.rope * x.max_seq * (x.h_q // x.a)


def weight_copies(x: Shape, n: Numerics, kept_blocks: int, head: bool, tp: int = 1, loss_chunks: int = 1) -> int:
    """Low-precision weights held for backward, once per step: autocast's cached copies
    of the matmul weights (blocks that recompute make theirs again in backward; the head's
    only when the loss is whole: in slices it keeps gradients, not the weight), or
    FSDP's gathered head weight (the root is not resharded after forward), and under a
    pipeline FSDP's gathered block weights (Numerics.gathered_blocks)."""
    head_bytes = n.compute * x.V * x.h if head and ((n.autocast and loss_chunks == 1) or n.gathered_head) else 0
    blocks = n.compute * kept_blocks * x.block_params // tp if n.autocast or n.gathered_blocks else 0
    return blocks + head_bytes


def recomputed(L: int, ac: ACMode, every: int, first: int = 0) -> int:
    """Blocks first .. first+L-1 that recompute: all under full and op; under selective
    those whose model-wide index is a multiple of `every` (a stage keeps the numbering)."""
    if ac in (ACMode.full, ACMode.op):
        return L
    if ac == ACMode.selective:
        return len(range(-(-first // every) * every, first + L, every))
    return 0


def activation_bytes(
    m: ModelConfig,
    micro_batch: int,
    seq_len: int,
    n: Numerics,
    ac: ACMode,
    ac_every: int = 2,
    layers: int | None = None,
    tp: int = 1,
    with_head: bool = True,
    with_embedding: bool = True,
    in_flight: int = 1,
    first_layer: int = 0,
    loss_chunks: int = 1,
    cp: int = 1,
    sp: bool = False,
) -> int:
    """What autograd holds on one rank at the end of forward: `in_flight` micro-batches'
    activations (a pipeline stage holds several), plus the rotary table and weight copies.

    A recomputed block keeps only its input (at op level also op_kept); the others keep
    block_activations. `layers` limits the count to a pipeline stage's blocks;
    `with_embedding` / `with_head` say whether the stage has the token ids / the final
    norm and logits (both, without a pipeline). sp: parallel.sequence_parallel under tp."""
    x = Shape.of(m, micro_batch, seq_len)
    n_layers = x.L if layers is None else layers
    r = recomputed(n_layers, ac, ac_every, first_layer)
    kept = op_kept(x, n, tp) if ac == ACMode.op else 0
    split = tp if sp else 1  # sequence parallel: the residual stream between blocks is split too
    per_micro_batch = (
        r * (n.residual * x.b * x.s * x.h // split + kept)
        + (n_layers - r) * block_activations(x, n, tp, cp, sp)
        + (head_activations(x, n, loss_chunks, split) if with_head else 0)
        + (token_ids(x) if with_embedding else 0)
    )
    once = (rope_table(x, n) if n_layers else 0) + weight_copies(x, n, n_layers - r, with_head, tp, loss_chunks)
    return in_flight * per_micro_batch + once


def document_mask(cfg, b: int, s: int, n: Numerics) -> int:
    """data.document_masking: the block-causal mask of a packed micro-batch, made once per
    forward and held by every layer until backward (launcher/models/attention.py). model=hf:
    SDPA's additive mask, b x s x s in the attention's dtype (bf16: 128 MiB a sequence at
    s=8192, 2% of a Llama 3 8B's activations under full recomputation, 0.2% without). The project's
    decoder on GPUs: FlexAttention's block mask, four int32 tables of (s/128)^2 blocks a
    sequence (64 KiB at 8192); its dense CPU mask (4 b s^2) is not planned."""
    if not cfg.data.document_masking:
        return 0
    if cfg.model.kind == ModelKind.hf:
        return n.compute * b * s * s
    return 16 * b * math.ceil(s / 128) ** 2


from launcher.planner.counter import ActivationCounter  # noqa: E402,F401  (its home before; measured against these terms)

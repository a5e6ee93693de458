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

from launcher.config import (ACMode, ModelConfig, block_matmul_params, ffn_dim, from_shape_key, is_moe_block, num_params,
                             shape_key)


@dataclass(frozen=True)
class Shape:
    """The sizes the formulas use, from a ModelConfig and the batch shape."""

    b: int
    s: int
    h: int
    a: int
    h_kv: int
    f: int
    V: int
    L: int
    max_seq: int
    block_params: int
    """Matmul weights of one block (launcher.config.block_matmul_params)."""

    @staticmethod
    def of(m: ModelConfig, micro_batch: int, seq_len: int) -> "Shape":
        head = m.dim // m.n_heads
        return Shape(b=micro_batch, s=seq_len, h=m.dim, a=m.n_heads, h_kv=(m.n_kv_heads or m.n_heads) * head,
                     f=ffn_dim(m), V=m.vocab_size, L=m.n_layers, max_seq=m.max_seq_len,
                     block_params=block_matmul_params(m))


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
    from launcher.models.gpt import GPT
    from launcher.models.init import skip_torch_init

    with torch.device("meta"), skip_torch_init():
        return GPT(m)


@functools.lru_cache(maxsize=32)
def _param_counts(key: tuple) -> ParamCounts:
    m = from_shape_key(key)
    model = _meta_gpt(m)
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    experts = [getattr(layer.feed_forward, "experts", None) for layer in model.layers]
    return ParamCounts(embed=count(model.tok_embeddings), head=0 if m.tie_embeddings else count(model.output),
                       blocks=tuple(count(layer) for layer in model.layers), final_norm=count(model.norm),
                       experts=tuple(count(e) if e is not None else 0 for e in experts))


def param_summary(m: ModelConfig) -> dict:
    """What `make plan` shows of the model: its total parameters, the active ones (a token's:
    an MoE's top k experts of E, launcher.config.num_params), and each run of like blocks
    (kind dense or moe, how many, parameters each, of them routed experts)."""
    c, runs = ParamCounts.of(m), []
    for i, (block, experts) in enumerate(zip(c.blocks, c.experts)):
        kind = "moe" if is_moe_block(m, i) else "dense"
        if runs and (runs[-1]["kind"], runs[-1]["params"]) == (kind, block):
            runs[-1]["count"] += 1
        else:
            runs.append({"kind": kind, "count": 1, "params": block, "experts": experts})
    return {"total": c.total, "active": num_params(m, active=True), "embed": c.embed, "head": c.head,
            "final_norm": c.final_norm, "experts": c.expert_total, "blocks": runs}


def param_line(m: ModelConfig) -> str:
    """param_summary in one line."""
    p, g = param_summary(m), lambda n: f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"  # noqa: E731
    blocks = ", ".join(f"{r['count']} {r['kind']} x {g(r['params'])}" + (f" (routed experts {g(r['experts'])})"
                                                                        if r["experts"] else "") for r in p["blocks"])
    return f"{m.name}: {g(p['total'])} parameters, {g(p['active'])} active per token; blocks: {blocks}"


@functools.lru_cache(maxsize=32)
def _group_sizes(key: tuple) -> tuple[tuple[int, ...], tuple[int, ...]]:
    model = _meta_gpt(from_shape_key(key))
    params = list(model.parameters())  # unique: a tied head is the embedding
    return tuple(p.numel() for p in params if p.ndim >= 2), tuple(p.numel() for p in params if p.ndim < 2)


def straddling(m: ModelConfig, world: int) -> int:
    """Elements DeepSpeed stage 1/2 hold beyond the rank's gradient partition, on the rank
    holding the most: each optimizer group (launcher.rank.engine.param_groups: matrices, then
    vectors, in model order) is flattened, padded to a multiple of 2N and cut into N equal
    partitions; a parameter crossing a partition's edge has its whole gradient kept for the
    reduce (deepspeed/runtime/zero/stage_1_and_2.py, get_all_grad_tensors over
    params_in_partition), not only its part inside. At most two such parameters per
    group and rank: for Llama-3-8B on 8 ranks a crossing embedding alone is half a shard."""
    worst = [0] * world
    for sizes in _group_sizes(shape_key(m)):
        step = -(-sum(sizes) // (2 * world)) * 2
        start = 0
        for size in sizes:
            end = start + size
            for r in range(start // step, min(world, -(-end // step))):
                inside = min(end, (r + 1) * step) - max(start, r * step)
                worst[r] += size - inside if inside < size else 0
            start = end
    return max(worst)


def persistent(m: ModelConfig, threshold: int) -> int:
    """Elements of the parameters ZeRO-3 keeps whole on every rank (numel <= threshold,
    stage3_param_persistence_threshold: deepspeed/runtime/zero/parameter_offload.py,
    mark_persistent_parameters): the norms, under the launcher's default of 10 x dim."""
    return sum(n for sizes in _group_sizes(shape_key(m)) for n in sizes if n <= threshold)


def largest_param(m: ModelConfig) -> int:
    """Elements of the model's largest parameter (the embedding, a SwiGLU matrix, an MoE's stacked experts)."""
    return max(max(sizes, default=0) for sizes in _group_sizes(shape_key(m)))


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


def block_activations(x: Shape, n: Numerics, tp: int = 1, cp: int = 1) -> int:
    """Bytes one block saves for backward (no recomputation). tp splits heads and SwiGLU
    width (norms, residual replicated); cp: x.s is this rank's positions (context.py)."""
    b, s, c = x.b, x.s, n.compute
    h_q, h_kv, heads, f = x.h // tp, x.h_kv // tp, x.a // tp, x.f // tp
    # q, k, v, out; fp32 logsumexp. GQA saves the repeated (full-width) k and v.
    sdpa = c * b * s * (2 * h_q + 2 * max(h_kv, h_q)) + 4 * b * heads * s
    mlp = 4 * c * b * s * f  # w1 out, w3 out, silu out, product
    exchanged = c * b * s * h_q if cp > 1 else 0  # context parallel: wo's own input
    return 2 * _norm(x, n) + _linear_inputs(x, n, 3) + sdpa + exchanged + _linear_inputs(x, n, 2) + mlp


def op_kept(x: Shape, n: Numerics, tp: int = 1) -> int:
    """activation_checkpointing=op: what a block keeps beside its input, the outputs of
    every other matmul (wq, wv before the GQA repeat, w1, w2; wk, wo, w3 run again) and of
    attention (+ fp32 logsumexp); launcher/models/gpt.py::keep_matmuls."""
    h_q, h_kv, f = x.h // tp, x.h_kv // tp, x.f // tp
    return n.compute * x.b * x.s * (h_q + h_kv + f + x.h + h_q) + 4 * x.b * (x.a // tp) * x.s


def head_activations(x: Shape, n: Numerics, loss_chunks: int = 1) -> int:
    """After the last block: final norm, the output matmul's input, the fp32
    log-softmax of the logits, the flat int64 targets. With the loss in slices
    (train.loss_chunks > 1, launcher/models/gpt.py::SlicedLoss): the final norm, and the
    gradients the slices computed in forward: dL/dh in h's dtype and dL/dweight in fp32
    (V x dim: 2.1 GB for Llama 3 8B, against the 4.2 GB fp32 log-softmax of one 8k sequence)."""
    if loss_chunks > 1:
        return _norm(x, n) + n.residual * x.b * x.s * x.h + 4 * x.V * x.h
    return _norm(x, n) + _linear_inputs(x, n, 1) + 4 * x.b * x.s * x.V + 8 * x.b * x.s


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
    return n.rope * x.max_seq * (x.h // x.a)


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


def activation_bytes(m: ModelConfig, micro_batch: int, seq_len: int, n: Numerics, ac: ACMode,
                     ac_every: int = 2, layers: int | None = None, tp: int = 1, with_head: bool = True,
                     with_embedding: bool = True, in_flight: int = 1, first_layer: int = 0,
                     loss_chunks: int = 1, cp: int = 1) -> int:
    """What autograd holds on one rank at the end of forward: `in_flight` micro-batches'
    activations (a pipeline stage holds several), plus the rotary table and weight copies.

    A recomputed block keeps only its input (at op level also op_kept); the others keep
    block_activations. `layers` limits the count to a pipeline stage's blocks;
    `with_embedding` / `with_head` say whether the stage has the token ids / the final
    norm and logits (both, without a pipeline)."""
    x = Shape.of(m, micro_batch, seq_len)
    n_layers = x.L if layers is None else layers
    r = recomputed(n_layers, ac, ac_every, first_layer)
    kept = op_kept(x, n, tp) if ac == ACMode.op else 0
    per_micro_batch = (r * (n.residual * x.b * x.s * x.h + kept) + (n_layers - r) * block_activations(x, n, tp, cp)
                       + (head_activations(x, n, loss_chunks) if with_head else 0)
                       + (token_ids(x) if with_embedding else 0))
    once = (rope_table(x, n) if n_layers else 0) + weight_copies(x, n, n_layers - r, with_head, tp, loss_chunks)
    return in_flight * per_micro_batch + once


# ----------------------------------------------------------------------------- ZeRO model states
def zero_paper_bytes(stage: int, psi: float, world: int) -> float:
    """The ZeRO paper's model states per rank for mixed-precision Adam (Rajbhandari et al.,
    2020, figure 1): Ψ parameters, N ranks."""
    n = world
    return {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]


def zero_states(stage: int, psi: float, world: int, grad_accum: int = 1, offload_optimizer: bool = False,
                offload_param: bool = False, largest_param: int = 0,
                weight_bytes: int = 2, straddle: int = 0, kept_whole: int = 0,
                bucket: int = 0) -> dict[str, tuple[float, float]]:
    """What DeepSpeed 0.19 really holds per rank at the peak of a step with Adam:
    {"params" | "grads" | "optim": (device bytes, host bytes)}. w = weight_bytes: 2 for
    bf16/fp16 weights, 4 in fp32. Measured in every cell by tests/e2e/test_plan_runs.py (the
    planner's matrix) and tests/e2e/test_zero.py (recipes/zero/engine.py::model_state_bytes sums it).

    The paper's terms, plus two it leaves out. For the update DeepSpeed makes an fp32 copy
    of the rank's gradient shard (4Ψ/N) next to the shard it reduced into (wΨ/N); and it
    keeps an fp32 master shard (4Ψ/N) even when the weights are fp32 themselves (fp32
    runs hold 4Ψ weights + 4Ψ/N master: deepspeed/runtime/zero/stage_1_and_2.py,
    `single_partition_of_fp32_groups` is a `.clone().float()` of the weights' shard;
    stage3.py `_create_fp32_partitions` likewise). So, per rank:
        stage 1: wΨ + 12Ψ/N + max(wΨ whole gradients while accumulating, (w+4)Ψ/N shards)
        stage 2: wΨ + 12Ψ/N + (w+4)Ψ/N
        stage 3: wΨ/N + 12Ψ/N + (w+4)Ψ/N
        stage 0 (bf16, not a recipe): 2Ψ weights + 2Ψ + 4Ψ grads + 4Ψ master + 8Ψ moments
    Left out, each under 2% here: stage 1/2's reduce buckets (reduce_bucket_size elements,
    two with overlap_comm), padding of the shards to the world size, Adam's step counters.
    Offload moves the fp32 master, the moments and the fp32 gradient shard to host memory.
    Stage 1/2 keep on the device a copy of the own weight shard for the upload (wΨ/N,
    counted with the weights) and one copy buffer of the largest parameter on each side
    (w x largest_param bytes, device and host; counted as gradients); while accumulating
    (grad_accum > 1) the reduced gradient shard is summed in host memory (wΨ/N). Stage 3
    keeps its gradient shard (wΨ/N) in host memory; parameter offload moves the weight
    shard there too. Stage 1/2 also keep the whole gradients of the parameters that cross
    the edge of the rank's partition (`straddle` elements beyond it: `straddling`) in the
    shard they reduce into, or accumulate in host memory. Stage 3 keeps its persistent
    parameters (`kept_whole` elements: `persistent`) whole on the device beside the shard
    (on more than one rank: on one, the shard is the whole parameter), and reduces
    gradients through a device bucket of `bucket` elements (reduce_bucket_size), with
    offload too.
    """
    n, p, w = world, psi, weight_bytes
    optim, grad_shards = 12 * p / n, (w + 4) * p / n
    edges = w * straddle if stage in (1, 2) else 0
    if stage == 0:
        return {"params": (2 * p, 0.0), "grads": (6 * p, 0.0), "optim": (12 * p, 0.0)}
    kept = w * kept_whole if stage == 3 and n > 1 else 0.0
    buckets = w * bucket if stage == 3 else 0.0
    whole = w * p if stage == 1 and grad_accum > 1 else 0.0  # stage 1 accumulates into whole gradients
    params = w * p / n if stage == 3 else w * p
    if not offload_optimizer:
        grads = max(whole, grad_shards + edges) if stage == 1 else grad_shards + edges + buckets
        return {"params": (params + kept, 0.0), "grads": (grads, 0.0), "optim": (optim, 0.0)}
    if stage in (1, 2):
        copy = w * largest_param
        accumulated = w * p / n + edges if grad_accum > 1 else 0.0
        return {"params": (params + w * p / n, 0.0), "grads": (whole + copy, 4 * p / n + accumulated + copy),
                "optim": (0.0, optim)}
    return {"params": (kept, params) if offload_param else (params + kept, 0.0), "grads": (buckets, grad_shards),
            "optim": (0.0, optim)}


from launcher.planner.counter import ActivationCounter  # noqa: E402,F401  (its home before; measured against these terms)

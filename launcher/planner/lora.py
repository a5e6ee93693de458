"""model.lora in the plan: trainable adapters beside a frozen base (docs/memory.md, LoRA).

The adapters are counted from the decoder's shape (no model is built): each targeted
projection W (in x out) of every layer gets r x (in + out) trainable parameters (T in
total); the other parameters, F of them, are frozen and held in the base dtype (2 bytes
under bf16/fp16, 4 under fp32), the targeted projections in about 0.52 bytes with
model.lora.base_dtype=nf4 (4-bit codes, an int8 scale per 64, an fp32 factor per 256
scales). A frozen parameter has no gradient and no optimizer state, so per rank:

    ddp    params F_b + 4T, grads 4T, optimizer 8T (adamw)     (b: base bytes; T: adapters)
    fsdp   the same over the n ranks that shard it
    zero   DeepSpeed's terms (zero.zero_states) for T, plus the frozen base in DeepSpeed's
           weight dtype (w bytes): whole on every rank under stage 1/2, w F / n under stage 3

The activations gain each adapter's r-wide output (b s r a bytes per projection) and,
with dropout, its dropped input and mask.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from launcher.config import LoraBase, ModelConfig, Precision, ffn_dim, from_shape_key, head_dim, shape_key
from launcher.planner import memory as M

HF_NAMES = {
    "q_proj": "wq",
    "k_proj": "wk",
    "v_proj": "wv",
    "o_proj": "wo",
    "gate_proj": "w1",
    "up_proj": "w3",
    "down_proj": "w2",
}
"""The Llama family's projection names (model=hf) on the project decoder's (the plan's shape)."""
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
"""torchao's NF4 tensor: 4-bit codes, an int8 scale per block of 64, an fp32 factor per 256 scales."""


@dataclass(frozen=True)
class Counts:
    trainable: int
    """T: the adapters' parameters."""
    frozen: int
    """F: every parameter of the base."""
    adapted: int
    """The frozen parameters of the targeted projections (what nf4 quantizes)."""
    projections: int
    """Targeted projections in the whole model (adapters: one A and one B each)."""


def projections(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each linear of a block: (in, out)."""
    head = head_dim(m)
    q, kv, f = m.n_heads * head, (m.n_kv_heads or m.n_heads) * head, ffn_dim(m)
    return {
        "wq": (m.dim, q),
        "wk": (m.dim, kv),
        "wv": (m.dim, kv),
        "wo": (q, m.dim),
        "w1": (m.dim, f),
        "w3": (m.dim, f),
        "w2": (f, m.dim),
    }


def counts(m: ModelConfig) -> Counts:
    lora = m.lora
    return _counts(
        shape_key(m), lora.rank, None if lora.targets is None else tuple(sorted(str(t) for t in lora.targets))
    )


@functools.lru_cache(maxsize=32)
def _counts(key: tuple, rank: int, targets: tuple | None) -> Counts:
    m = from_shape_key(key)
    wanted = None if targets is None else {HF_NAMES.get(t, t) for t in targets}
    chosen = [io for name, io in projections(m).items() if wanted is None or name in wanted]
    return Counts(
        trainable=m.n_layers * sum(rank * (i + o) for i, o in chosen),
        frozen=M.ParamCounts.of(m).total,
        adapted=m.n_layers * sum(i * o for i, o in chosen),
        projections=m.n_layers * len(chosen),
    )


ENGINES = ("ddp", "fsdp", "zero")
"""The engines adapters train under (without tensor or pipeline parallel); nf4: ddp alone."""


def adapter_tensors(m: ModelConfig) -> tuple[tuple[tuple[int, ...], bool], ...]:
    """(shape, False) of every adapter matrix: A (r x in) and B (out x r) per projection."""
    wanted = None if m.lora.targets is None else {HF_NAMES.get(str(t), str(t)) for t in m.lora.targets}
    r = m.lora.rank
    one = [
        shape
        for name, (i, o) in projections(m).items()
        if wanted is None or name in wanted
        for shape in ((r, i), (o, r))
    ]
    return tuple(((shape, False) for shape in one)) * m.n_layers


def persistent(m: ModelConfig, threshold: int) -> int:
    """Adapter elements ZeRO-3 keeps whole on every rank (numel <= its persistence
    threshold, 10 x dim by default: rank 8 on a 4096-wide model's attention, for one)."""
    if not enabled(m):
        return 0
    return sum(math.prod(shape) for shape, _ in adapter_tensors(m) if math.prod(shape) <= threshold)


def enabled(m: ModelConfig) -> bool:
    return m.lora.rank > 0


def runs_under(m: ModelConfig, engine: str, tp: int, pp: int) -> bool:
    """Whether a LoRA run of `m` can use this engine and these degrees (any, without LoRA)."""
    if not enabled(m):
        return True
    allowed = ("ddp",) if m.lora.base_dtype == LoraBase.nf4 else ENGINES
    return engine in allowed and tp == pp == 1


def base_bytes(m: ModelConfig, precision: Precision) -> int:
    """Bytes of the frozen base on one unsharded rank (launcher/models/lora.py's base_dtype)."""
    c = counts(m)
    b = {LoraBase.fp32: 4, LoraBase.bf16: 2}.get(
        m.lora.base_dtype, 2 if precision in (Precision.bf16, Precision.fp16) else 4
    )
    if m.lora.base_dtype == LoraBase.nf4:
        return int((c.frozen - c.adapted) * b + c.adapted * NF4_BYTES)
    return c.frozen * b


def states(
    m: ModelConfig,
    precision: Precision,
    shard: str,
    n: int,
    fsdp: bool,
    w: int,
    zero_terms,
    optimizer,
    threshold: int = 0,
) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes on one rank (module docstring). `zero_terms(T)`:
    DeepSpeed's {"params"|"grads"|"optim": (device, host)} for T trainable parameters;
    `optimizer(T, n)`: optim.name's state bytes for T adapters over n ranks (8T/n: adamw);
    `threshold`: ZeRO-3's persistence threshold."""
    c = counts(m)
    t = c.trainable
    if shard == "none":
        return base_bytes(m, precision) + 4 * t, 4 * t, optimizer(t, 1)
    if fsdp:
        return (base_bytes(m, precision) + 4 * t) // n, 4 * t // n, optimizer(t, n)
    parts = zero_terms(t)
    frozen = w * c.frozen // (n if shard == "zero3" else 1)
    params, grads, optim = (int(d + h) for d, h in parts.values())
    if shard == "zero3":  # an adapter kept whole (zero_terms counts it) holds no partition beside it (measured)
        params -= w * persistent(m, threshold) // n
    return params + frozen, grads, optim


def start_up(m: ModelConfig, precision: Precision, shard: str, n: int, fsdp: bool, grad_buckets: bool, w: int) -> int:
    """Device bytes at start-up: the base materialized in its dtype before nf4 quantizes it
    (2 bytes a parameter under bf16), the adapters as a full run's parameters, ddp's buckets
    of them; DeepSpeed's set-up (its fp32 master and gradient shards) of the adapters."""
    c = counts(m)
    t = c.trainable
    whole = c.frozen * (2 if precision in (Precision.bf16, Precision.fp16) else 4)
    base = max(whole, base_bytes(m, precision))
    if shard == "none":
        return base + 4 * t + (4 * t if grad_buckets else 0)
    if fsdp:
        return (base + 4 * t) // n
    return w * c.frozen // (n if shard == "zero3" else 1) + w * t + 8 * t // n


def activation_delta(
    m: ModelConfig, precision: Precision, b: int, s: int, n: M.Numerics, kept: int, copies: int
) -> int:
    """What the adapters change in the activations of the `kept` blocks that keep theirs:
    their own (activations()), less autocast's weight copies (`copies`), which a base held
    in the compute dtype never makes."""
    extra = activations(m, b, s, n.compute) * kept // m.n_layers
    if n.autocast and base_bytes(m, precision) < 4 * counts(m).frozen:
        extra -= copies
    return extra


def activations(m: ModelConfig, b: int, s: int, act_bytes: int) -> int:
    """What the adapters add to one micro-batch's saved activations: A's output (b s r)
    per projection, and with dropout its input (b s in) and a one-byte mask."""
    lora = m.lora
    extra = counts(m).projections * b * s * lora.rank * act_bytes
    if lora.dropout > 0:
        wanted = None if lora.targets is None else {HF_NAMES.get(str(t), str(t)) for t in lora.targets}
        ins = sum(i for name, (i, _) in projections(m).items() if wanted is None or name in wanted)
        extra += m.n_layers * b * s * ins * (act_bytes + 1)
    return extra

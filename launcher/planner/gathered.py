"""ZeRO-3's and FSDP2's gathered working set: the parameters a rank holds whole at once, at the
peak of forward and of backward, by the engines' own rules (issue 49 item 4; docs/memory.md,
"The gathered working set").

DeepSpeed (deepspeed/runtime/zero/partitioned_param_coordinator.py, 0.19.8) does not gather
"two blocks": it gathers module by module and its limits are read as follows.
- fetch_sub_module gathers the module about to run whole, whatever its size: the
  `stage3_max_live_parameters` cap (max_live) never stops it (the head of a 128k
  vocabulary, 1.05e9 elements at dim 8192, is gathered beyond the default cap of 1e9).
- Then it prefetches from the step's recorded parameter order: whole parameters, until it
  has taken at least min(max_live - gathered now, stage3_prefetch_bucket_size) elements (lines
  452-481): the last one may overshoot the bucket by up to one parameter, and nothing
  is prefetched while the head alone exceeds max_live.
- After a module runs it is released unless one of its parameters is used again within
  stage3_max_reuse_distance elements of the recorded order (`__params_to_release`): the
  head is kept from its forward into its backward; behind a head of 1.05e9 elements the
  last block's is not (the window closes at the head), behind a smaller head it may be.
- Parameters at or below stage3_param_persistence_threshold stay whole for the run (the
  norms): in the model states (zero.persistent), not here.
- A module's gradient is whole (compute dtype) when its backward makes it; DeepSpeed copies
  it into the reduce bucket only when it fits there (stage3.py `__add_grad_to_ipg_bucket`),
  so the head's (V x dim) is reduce-scattered from its own tensor, beside the gathered weight.
`deepspeed` replays these rules on the model's recorded order (the trace DeepSpeed records on
the first step: the embedding, each block's wq wk wv wo w1 w3 w2, the head, then backward in
reverse). Activation recomputation is not replayed: a recomputed block's forward hooks run
again just before its backward, which needs the same modules (checked against DeepSpeed
without recomputation only: tests/unit/test_gathered.py).

FSDP2 (torch/distributed/fsdp/_fully_shard/, `fsdp`): one unit per block, the root (embedding,
final norm, head) never resharded (launcher/parallel/mesh.py::apply_fsdp). Forward holds the
root, the block that computes and the next one's all-gather; backward the same (implicit
backward prefetch of one block). With recipe.fsdp.reshard_after_forward=false a block stays
gathered from its forward to its backward: at the turn every block is. The root's gradients
are reduce-scattered in its post-backward, after the embedding's gradient, the step's last:
the head's whole gradient is held from the first module of backward to its end.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from dataclasses import dataclass
from typing import NamedTuple

from launcher.config import ModelConfig, block_matmul_params, ffn_dim, from_shape_key, shape_key
from launcher.parallel import ds_config
from launcher.planner import lora, moe


@dataclass(frozen=True)
class WorkingSet:
    """Elements (compute dtype) one rank holds gathered, beyond its shards and persistent parameters."""

    forward: int
    """At forward's peak."""
    backward: int
    """At backward's peak, the whole gradient of the module running backward included."""
    head: int
    """The output head's weight (V x dim; 0 when tied: the embedding's, gathered with it)."""
    head_grad: int
    """The head's (or a tied embedding's) gradient, whole, while its backward runs."""
    at_peak: str
    """What is gathered at the larger of the two peaks, in words."""

    @property
    def peak(self) -> int:
        return max(self.forward, self.backward)


FORWARD = (
    "",
    "attention_norm",
    "attention",
    "attention.wq",
    "attention.wk",
    "attention.wv",
    "attention.wo",
    "ffn_norm",
    "feed_forward",
    "feed_forward.w1",
    "feed_forward.w3",
    "feed_forward.w2",
)
"""A block's modules in the order their forward hooks run (launcher/models/gpt.py Block,
Attention, FeedForward); "" is the block itself."""
BACKWARD = (
    "",
    "feed_forward",
    "feed_forward.w2",
    "feed_forward.w3",
    "feed_forward.w1",
    "ffn_norm",
    "attention",
    "attention.wo",
    "attention.wv",
    "attention.wk",
    "attention.wq",
    "attention_norm",
)
"""The order their backward hooks run (autograd takes the later-made of two ready nodes first: w3 before w1)."""


def trace(m: ModelConfig, threshold: int = 0) -> list[tuple[str, bool, tuple[tuple[str, int], ...]]]:
    """One step's recorded order, every module whose hook runs (the model, blocks and norms
    too: each call prefetches, parameters or not): (module, forward?, its parameters above
    the persistence `threshold`, (name, elements)). A tied head's parameter is the embedding's."""
    kv = (m.n_kv_heads or m.n_heads) * (m.dim // m.n_heads)
    f, h, vh = ffn_dim(m), m.dim, m.vocab_size * m.dim
    sizes = {
        "attention.wq": h * h,
        "attention.wk": h * kv,
        "attention.wv": h * kv,
        "attention.wo": h * h,
        "feed_forward.w1": h * f,
        "feed_forward.w3": h * f,
        "feed_forward.w2": f * h,
    }

    def block(i: int, order: tuple[str, ...], forward: bool) -> list:
        name = lambda k: f"layers.{i}" + (f".{k}" if k else "")  # noqa: E731
        return [(name(k), forward, ((name(k), sizes[k]),) if k in sizes else ()) for k in order]

    head = ("output", (("tok_embeddings" if m.tie_embeddings else "output", vh),))
    out = [("", True, ()), ("tok_embeddings", True, (("tok_embeddings", vh),))]
    out += [s for i in range(m.n_layers) for s in block(i, FORWARD, True)]
    out += [
        ("norm", True, ()),
        (*head[:1], True, head[1]),
        ("", False, ()),
        (*head[:1], False, head[1]),
        ("norm", False, ()),
    ]
    out += [s for i in reversed(range(m.n_layers)) for s in block(i, BACKWARD, False)]
    out.append(("tok_embeddings", False, (("tok_embeddings", vh),)))
    return [(name, fwd, tuple(p for p in ps if p[1] > threshold)) for name, fwd, ps in out]


class Step(NamedTuple):
    """One module's hook in `replay`, after its fetch and prefetch, before its release."""

    module: str
    forward: bool
    held: int
    """Elements gathered."""
    grad: int
    """Elements of the module's own whole gradient (backward)."""
    gathered: frozenset
    fetched: int
    """Elements this hook all-gathered for its module."""
    prefetched: int
    """Elements it all-gathered ahead."""


def of_layout(cfg, layout) -> dict:
    """The working set of a plan's row (WorkingSet's fields) under DeepSpeed ZeRO-3 or FSDP2
    (reshard_after_forward as the recipe sets it); {} for the other layouts, model.moe, model.lora, a pipeline."""
    if layout.shard != "zero3" or moe.enabled(cfg.model) or lora.enabled(cfg.model) or layout.pp > 1:
        return {}
    if layout.fsdp:
        ws = fsdp(cfg.model, block_matmul_params(cfg.model), cfg.recipe.fsdp.reshard_after_forward, layout.tp)
    else:
        ws = of_config(cfg)
    return dataclasses.asdict(ws)


def of_config(cfg) -> WorkingSet:
    """DeepSpeed ZeRO-3's working set for a composed config, its thresholds as ds_config.json has them."""
    z = cfg.recipe.zero
    return _cached(
        shape_key(cfg.model),
        z.max_live_parameters,
        ds_config.prefetch_bucket(cfg),
        z.max_reuse_distance,
        ds_config.persistence_threshold(cfg),
    )


@functools.lru_cache(maxsize=64)
def _cached(key: tuple, max_live: int, prefetch: int, reuse: int, threshold: int) -> WorkingSet:
    return deepspeed(from_shape_key(key), max_live, prefetch, reuse, threshold)


def deepspeed(m: ModelConfig, max_live: int, prefetch: int, reuse: int, threshold: int) -> WorkingSet:
    """The peak of each pass of `replay`: the gathered set, and in backward the whole
    gradient of the module whose backward runs beside it."""
    peak = {True: (0, ""), False: (0, "")}
    numel = {p: n for _, _, ps in trace(m, threshold) for p, n in ps}
    for s in replay(m, max_live, prefetch, reuse, threshold):
        if s.held + s.grad > peak[s.forward][0]:
            peak[s.forward] = (
                s.held + s.grad,
                f"{s.module} ({'forward' if s.forward else 'backward'}): " + _names(s.gathered, numel),
            )
    top = peak[True] if peak[True][0] >= peak[False][0] else peak[False]
    return WorkingSet(
        forward=peak[True][0],
        backward=peak[False][0],
        head=0 if m.tie_embeddings else m.vocab_size * m.dim,
        head_grad=m.vocab_size * m.dim,
        at_peak=top[1],
    )


def replay(m: ModelConfig, max_live: int, prefetch: int, reuse: int, threshold: int):
    """Replays partitioned_param_coordinator's fetch, prefetch and release on one recorded
    step of `m` (the module docstring's rules). Yields, after each module's fetch and
    prefetch and before its release: (module, forward?, elements gathered, elements of the
    module's own whole gradient in backward, the gathered set in words)."""
    steps = trace(m, threshold)
    numel = {p: n for _, _, ps in steps for p, n in ps}
    queue = collections.deque((p, i) for i, (_, _, ps) in enumerate(steps) for p, _ in ps)
    avail: set[str] = set()
    recent: dict[str, int] = {}
    for i, (name, forward, ps) in enumerate(steps):
        mine = {p for p, _ in ps}
        fetched = sum(numel[p] for p in mine - avail)
        avail |= mine
        _pop(queue, recent, {p for p in mine if recent.get(p, -1) < i})
        ahead = _prefetch(queue, recent, avail, numel, min(max_live - sum(numel[p] for p in avail), prefetch))
        avail |= ahead
        yield Step(
            name,
            forward,
            sum(numel[p] for p in avail),
            0 if forward else sum(numel[p] for p in mine),
            frozenset(avail),
            fetched,
            sum(numel[p] for p in ahead),
        )
        avail -= _released(steps, numel, recent, mine, i + 1, reuse)


def gathers(m: ModelConfig, max_live: int, prefetch: int, reuse: int, threshold: int) -> dict[bool, tuple[int, int]]:
    """{forward?: (all-gathers launched, elements gathered)} in one micro-batch's pass: a
    fetch and a prefetch are one all_gather_coalesced each (`__all_gather_params`)."""
    out = {True: (0, 0), False: (0, 0)}
    for s in replay(m, max_live, prefetch, reuse, threshold):
        n, elements = out[s.forward]
        out[s.forward] = (n + (s.fetched > 0) + (s.prefetched > 0), elements + s.fetched + s.prefetched)
    return out


def _pop(queue, recent: dict, wanted: set) -> None:
    """The current module's own entries leave the prefetch queue (fetch_sub_module's `discarded_from_prefetch_queue`)."""
    for _ in range(len(wanted)):
        if not queue:
            return
        p, step = queue.popleft()
        recent[p] = step


def _prefetch(queue, recent: dict, avail: set, numel: dict, budget: int) -> set:
    """Whole parameters from the queue until `budget` elements are taken (the last may overshoot)."""
    taken, n = set(), 0
    while queue and n < budget:
        p, step = queue.popleft()
        recent[p] = max(recent.get(p, -1), step)
        if p not in avail and p not in taken:
            taken.add(p)
            n += numel[p]
    return taken


def _released(steps, numel: dict, recent: dict, mine: set, step: int, reuse: int) -> set:
    """`__params_to_release`: the module's parameters not prefetched for a later use and not
    used again within `reuse` elements of the order from `step` on."""
    out = {p for p in mine if recent.get(p, -1) <= step}
    seen = 0
    for _, _, ps in steps[step:]:
        if seen >= reuse:
            break
        for p, n in ps:
            out.discard(p)
            seen += n
    return out


def _names(avail: set, numel: dict) -> str:
    """Gathered parameters in words: whole blocks counted, the rest named."""
    blocks = collections.Counter(p.split(".")[1] for p in avail if p.startswith("layers."))
    whole = sum(1 for b, k in blocks.items() if k == 7)
    parts = sorted(p for p in avail if p.startswith("layers.") and blocks[p.split(".")[1]] < 7)
    named = [
        "head" if "output" in avail else "",
        "embedding" if "tok_embeddings" in avail else "",
        f"{whole} whole block(s)" if whole else "",
        " ".join(parts[:6]) + (" ..." if len(parts) > 6 else ""),
    ]
    return ", ".join(x for x in named if x) + f" = {sum(numel[p] for p in avail) / 1e9:.2f}e9 elements"


def fsdp(m: ModelConfig, block: int, reshard_after_forward: bool, tp: int = 1) -> WorkingSet:
    """FSDP2's working set (module docstring): the root (embedding, and the head when untied)
    through both passes, two blocks (the one that computes, the next's all-gather), every
    block at the turn without resharding, and the head's whole gradient in backward."""
    head = 0 if m.tie_embeddings else m.vocab_size * m.dim
    root = m.vocab_size * m.dim + head
    blocks = 2 if reshard_after_forward else m.n_layers
    words = "root (embedding, head), " + (
        "two blocks" if reshard_after_forward else f"all {m.n_layers} blocks at the turn"
    )
    return WorkingSet(
        forward=(root + 2 * block) // tp,
        backward=(root + blocks * block + m.vocab_size * m.dim) // tp,
        head=head // tp,
        head_grad=m.vocab_size * m.dim // tp,
        at_peak=words,
    )

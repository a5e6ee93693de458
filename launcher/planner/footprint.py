"""What one rank of a planned layout holds: its model states (parameters, gradients,
optimizer states, where each lives), its start-up peak, the activations and temporaries
of a micro-batch. The terms are launcher/planner/memory.py's; `make plan` (launcher/planner/plan.py) adds
them up per layout and finds what fits; docs/memory.md derives them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from launcher.config import ACMode, Config, ModelConfig, Precision, loss_chunks, sliceable_loss
from launcher.parallel import ds_config
from launcher.parallel.cuts import stage_bounds
from launcher.planner import lora, moe
from launcher.planner import memory as M
from launcher.planner import zero as Z
from launcher.planner.optimizer import optimizer_states


@dataclass(frozen=True)
class Layout:
    """A recipe and its degrees. `shard` says how model states split over the
    data-parallel ranks: none (replicated), zero1, zero2, zero3 (ZeRO-3 and FSDP)."""

    recipe: str
    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    """Context parallel: the sequence split over cp ranks (activations / cp); FSDP shards
    over dp x cp (launcher/parallel/mesh.py::data_parallel_mesh)."""
    ep: int = 1
    """model.moe: the routed experts split over ep of the dp x cp ranks (launcher/planner/moe.py)."""
    shard: str = "none"
    offload_optim: bool = False
    offload_params: bool = False
    fsdp: bool = False
    grad_buckets: bool = False
    """DDP: gradient buckets as big as the model, allocated at start-up."""
    grads_freed: bool = False
    """The engine frees the gradients after each step (engines.Holding.grads_freed)."""

    @property
    def label(self) -> str:
        degrees = [f"dp{self.dp}"] + [
            f"{k}{v}" for k, v in (("cp", self.cp), ("tp", self.tp), ("pp", self.pp), ("ep", self.ep)) if v > 1
        ]
        return f"{self.recipe} ({' '.join(degrees)})"

    def overrides(self) -> list[str]:
        return [f"recipe={self.recipe}"] + [
            f"parallel.{k}={v}"
            for k, v in (("tp", self.tp), ("pp", self.pp), ("cp", self.cp), ("ep", self.ep))
            if v > 1
        ]

    @property
    def shard_ranks(self) -> int:
        """The ranks sharded model states split over: the data-parallel ones, and under
        FSDP the context-parallel ones too (they hold the same parameters)."""
        return self.dp * self.cp if self.fsdp else self.dp

    def seq(self, seq_len: int) -> int:
        """Positions one rank holds of each sequence (parallel.cp splits them)."""
        return seq_len // self.cp


# ----------------------------------------------------------------------------- states
def ds_weight_bytes(cfg: Config) -> int:
    """w: bytes of each of DeepSpeed's weights (and gradients): 4 in fp32, else 2."""
    return 4 if cfg.precision.name == Precision.fp32 else 2


def pipeline(cfg: Config) -> tuple[int, int, str, list[int] | None]:
    """(micro-batches, stages per rank, schedule, user split) of the pipeline settings."""
    p = getattr(cfg, "parallel", None)
    if p is None:
        return 1, 1, "1f1b", None
    schedule = p.pp_schedule.value
    virtual = p.pp_virtual_stages if schedule == "interleaved_1f1b" else 1
    return p.pp_microbatches, virtual, schedule, p.pp_split


def stage_ranks(cfg: Config, layout: Layout) -> list[list[tuple[int, int, bool, bool]]]:
    """For each pipeline rank, its stages as (first layer, end layer, has embedding,
    has head) -- launcher.parallel.cuts.stage_bounds, as the pp recipe cuts them."""
    _, virtual, _, split = pipeline(cfg)
    n_stages = layout.pp * virtual
    bounds = stage_bounds(cfg.model, n_stages, split)
    return [[(*bounds[s], s == 0, s == n_stages - 1) for s in range(r, n_stages, layout.pp)] for r in range(layout.pp)]


def param_share(cfg: Config, layout: Layout, pp_rank: int | None = None) -> int:
    """Parameters one rank holds before data-parallel sharding: pipeline rank `pp_rank`,
    or the worst rank."""
    m = cfg.model
    c = M.ParamCounts.of(m)
    t = layout.tp
    # Tensor parallel splits the matrices and leaves the norms whole; a tied embedding is
    # whole too (one parameter shared with the head), an untied embedding and head split
    # by vocabulary.
    blocks = [(b - 2 * m.dim) // t + 2 * m.dim for b in c.blocks]
    embed = c.embed if m.tie_embeddings else c.embed // t
    head = c.embed if m.tie_embeddings else c.head // t
    if layout.pp > 1:
        # The first stage holds the embedding, the last the final norm and the head (a
        # tied head is a copy there).
        shares = [
            sum(
                sum(blocks[first:end]) + (embed if emb else 0) + (head + c.final_norm if last else 0)
                for first, end, emb, last in stages
            )
            for stages in stage_ranks(cfg, layout)
        ]
        return max(shares) if pp_rank is None else shares[pp_rank]
    if t > 1:
        return sum(blocks) + c.final_norm + (embed if m.tie_embeddings else embed + head)
    return moe.rank_params(m, layout.ep)  # model.moe: E/ep of each block's experts


def model_states(
    cfg: Config, layout: Layout, pp_rank: int | None = None, shard_rank: int = 0
) -> tuple[int, int, int, dict[str, str], dict[str, int]]:
    """(params, grads, optimizer) bytes on one rank, where each lives (device, cpu or
    device+cpu) and how many of them are in host memory (offload).

    DDP, TP and PP under autocast keep fp32 parameters and gradients (4 + 4 + 8 bytes per
    parameter with Adam). FSDP2 with a bf16 MixedPrecisionPolicy shards fp32 parameters,
    fp32 gradients and the moments (16 per parameter, all sharded). DeepSpeed holds what
    launcher.planner.zero.zero_states says, measured in every precision: the ZeRO paper's terms
    with w-byte weights (w = 2, or 4 in fp32), plus an fp32 copy of the gradient shard and
    an fp32 master shard even in fp32, with offload splitting parts to the host. `shard_rank`:
    the rank's place among the n it shards over (FSDP's MoE experts differ by rank: moe.fsdp_elements).
    """
    P = param_share(cfg, layout, pp_rank)
    n = layout.shard_ranks
    where = {"params": "device", "grads": "device", "optim": "device"}
    host = {"params": 0, "grads": 0, "optim": 0}
    if lora.enabled(cfg.model):  # adapters train, the base is frozen (launcher/planner/lora.py)
        return (
            *lora.states(
                cfg.model,
                cfg.precision.name,
                layout.shard,
                n,
                layout.fsdp,
                ds_weight_bytes(cfg),
                lambda t: zero_terms(cfg, layout, t),
                lambda t, k: optimizer_states(cfg, t, k),
                ds_config.persistence_threshold(cfg),
            ),
            where,
            host,
        )
    if layout.shard == "none":
        params, grads, optim = 4 * P, 4 * P, optimizer_states(cfg, P, 1)
    elif layout.fsdp:  # model.moe: the experts over their own ranks, on dim 0 or 1 (moe.fsdp_elements)
        S = (
            moe.fsdp_elements(cfg.model, n, layout.ep, shard_rank) * n if moe.enabled(cfg.model) else P
        )  # n x the rank's
        params, grads, optim = 4 * S // n, 4 * S // n, optimizer_states(cfg, S, n)
    else:
        parts = zero_terms(cfg, layout, P)
        params, grads, optim = (int(d + h) for d, h in parts.values())
        for k, (d, h) in parts.items():
            host[k] = int(h)
            where[k] = "cpu" if not d else ("device+cpu" if h else "device")
    return params, grads, optim, where, host


def zero_terms(cfg: Config, layout: Layout, P: int) -> dict[str, tuple[float, float]]:
    """DeepSpeed's model states for P trained parameters on one rank (zero.zero_states)."""
    n = layout.shard_ranks
    return Z.zero_states(
        int(layout.shard[-1]),
        P,
        n,
        cfg.train.grad_accum,
        layout.offload_optim,
        layout.offload_params,
        largest_param=Z.largest_param(cfg.model),
        weight_bytes=ds_weight_bytes(cfg),
        straddle=Z.straddling(cfg.model, n),
        kept_whole=Z.persistent(cfg.model, ds_config.persistence_threshold(cfg))
        + lora.persistent(cfg.model, ds_config.persistence_threshold(cfg)),
        bucket=ds_config.reduce_bucket(cfg),
        sub_group=Z.sub_group(cfg, layout.shard_ranks, P),
    )


def trained_share(cfg: Config, layout: Layout) -> int:
    """The parameters one rank trains before sharding: all it holds, or model.lora's adapters."""
    return lora.counts(cfg.model).trainable if lora.enabled(cfg.model) else param_share(cfg, layout)


def grads_kept(cfg: Config, layout: Layout, grads: int) -> int:
    """Device bytes of gradients a rank holds while the forward's activations are alive,
    of the `grads` it holds at the update: all of them where the engine keeps them between
    steps (ddp's buckets, the offloaded ZeRO recipes) or accumulates them over micro-batches
    (grad_accum > 1, a pipeline); where it frees them after each update (Layout.grads_freed)
    and backward makes them as it frees the activations, only what it keeps regardless:
      fsdp, tp, tp_fsdp   nothing
      zero1               nothing: the gradients backward makes are reduced and cleared after
                          it (grads_at_peak counts them), the fp32 copy of the shard is made by the step
      zero2               the wP/n shard the buckets reduce into (grads_in_partition, made at
                          backward's first reduction and freed by the step) and the gradients
                          of the parameters across its edges
      zero3               the wP/n gradient partition (made at start-up, never freed) and the
                          reduce bucket
    Measured on an H200 (bench/gpu.md) and against torch's MemTracker (tests/unit/test_step_peak.py)."""
    if not layout.grads_freed or cfg.train.grad_accum > 1:
        return grads
    if layout.fsdp or layout.shard in ("none", "zero1"):
        return 0
    w = ds_weight_bytes(cfg)
    n = layout.shard_ranks
    shard = w * trained_share(cfg, layout) // n
    if layout.shard == "zero2":
        return shard + w * Z.straddling(cfg.model, n)
    return shard + w * ds_config.reduce_bucket(cfg)


def grads_at_peak(cfg: Config, layout: Layout, grads: int) -> int:
    """The most gradient bytes a rank holds at once once the activations are gone (the end
    of backward, the update): the `grads` of the update, and for DeepSpeed's ZeRO without
    offload, more for a moment:
      zero1-3   + wP/n: the update flattens the reduced shard into a copy before casting it to
                fp32 (stage_1_and_2.py:3106-3111, stage3.py:2686-2687: `flatten(averaged_gradients)`),
                so shard, flat copy and fp32 copy are alive together; zero3 one sub-group's at a
                time (wS: sub_group)
      zero1     at least wP + w x bucket without overlap_comm (the recipe's default): the
                whole gradients build up through backward and are reduced after it
                (reduce_gradients), through one bucket"""
    if not layout.shard.startswith("zero") or layout.fsdp or layout.offload_optim:
        return grads
    w = ds_weight_bytes(cfg)
    P = trained_share(cfg, layout)
    flat = Z.sub_group(cfg, layout.shard_ranks, P) if layout.shard == "zero3" else P // layout.shard_ranks
    peak = grads + w * flat
    if layout.shard == "zero1" and not ds_config.overlap_comm(cfg):
        peak = max(peak, w * P + w * ds_config.reduce_bucket(cfg))
    return peak


# ----------------------------------------------------------------------------- start-up
def start_up(cfg: Config, layout: Layout) -> tuple[int, int]:
    """(device bytes, host bytes) one rank holds when its engine is ready, before step 1:
    the model is built on the meta device and each rank allocates only its part
    (launcher/models/init.py); what the engine adds before the first step is the recipe's
    own. P is what the rank holds before data-parallel sharding (param_share), Ψ the
    whole model, w the bytes of DeepSpeed's weights (2 in bf16/fp16, 4 in fp32), n the
    data-parallel size. docs/memory.md derives each line; tests/e2e/test_startup.py measures them.

      ddp                4P weights + 4P DDP's gradient buckets (allocated at construction)
      tp, pp             4P weights (Adam's moments appear in the first step)
      fsdp, tp_fsdp      4P/n weight shards (cpu_offload: in host memory)
      zero1, zero2       wΨ weights + 4Ψ/n fp32 master shard + 4Ψ/n fp32 gradient shard
                         (DeepSpeed's optimizer set-up)
      zero2_offload      device: wΨ weights + wL copy buffer; host: 4Ψ/n master + 4Ψ/n fp32
                         gradient shard + wΨ/n upload copy of the shard (pinned) + wL copy buffer
      zero3              wΨ/n weight partition + wΨ/n gradient partitions + 4Ψ/n master
                         + 4S the set-up's gradient buffer (S: the largest sub-group, zero.sub_group)
      zero3_offload      host: all of zero3's + 4Ψ/n the fp32 gradients of the CPU update
    (L: the largest parameter's elements.) Reading model.pretrained adds at most one 16 MiB
    chunk per rank (launcher/models/weights.py)."""
    P = param_share(cfg, layout)
    n = layout.shard_ranks
    psi = M.ParamCounts.of(cfg.model).total
    w = ds_weight_bytes(cfg)
    if lora.enabled(cfg.model):  # the base in its dtype, the adapters as a full run's parameters
        return lora.start_up(cfg.model, cfg.precision.name, layout.shard, n, layout.fsdp, layout.grad_buckets, w), 0
    if layout.shard == "none":  # under parallel.ep the experts stay out of DDP's buckets (moe.outside_ddp)
        return 4 * P + (4 * (P - moe.outside_ddp(cfg.model, layout.ep)) if layout.grad_buckets else 0), 0
    if layout.fsdp:
        shard = 4 * (moe.fsdp_elements(cfg.model, n, layout.ep) * n if moe.enabled(cfg.model) else P) // n
        return (0, shard) if layout.offload_params else (shard, 0)  # recipe.fsdp.cpu_offload
    if layout.shard in ("zero1", "zero2"):
        if layout.offload_optim:
            largest = w * Z.largest_param(cfg.model)
            return w * psi + largest, 8 * psi // n + w * psi // n + largest
        return w * psi + 8 * psi // n, 0
    weights, grads, optimizer = w * psi // n, w * psi // n, 4 * psi // n + 4 * Z.sub_group(cfg, n, psi)
    if layout.offload_optim:
        optimizer += 4 * psi // n  # the CPU update's fp32 gradients
    device = (0 if layout.offload_params else weights) + (0 if layout.offload_optim else grads + optimizer)
    host = (weights if layout.offload_params else 0) + (grads + optimizer if layout.offload_optim else 0)
    return device, host


# ----------------------------------------------------------------------------- step memory
def numerics(precision: Precision, layout: Layout) -> M.Numerics:
    """DeepSpeed (bf16) casts the parameters (the rotary table stays fp32, measured);
    FSDP2's bf16 policy casts the parameters it gathers; DDP, TP and PP run fp32
    parameters under autocast."""
    if layout.shard.startswith("zero") and not layout.fsdp:
        return M.Numerics.of(precision.value, low_precision_params=True)
    if layout.fsdp:
        return dataclasses.replace(
            M.Numerics.of(precision.value, low_precision_params=True), gathered_head=True, gathered_blocks=layout.pp > 1
        )
    return M.Numerics.of(precision.value)


def activations(
    cfg: Config, layout: Layout, ac: ACMode, b: int, pp_rank: int | None = None, where: str = "device"
) -> int:
    """Saved activations on pipeline rank `pp_rank`, or the worst rank.

    A pipeline cuts each data-parallel rank's batch (b x grad_accum sequences) into
    parallel.pp_microbatches; a stage keeps the activations of every micro-batch it has
    run forward but not yet backward: all of them under GPipe, pp - s for stage s under
    1F1B (interleaved: the same rule over the virtual stages).

    train.activation_offload moves what the blocks that do not recompute save (their
    activations and autocast's weight copies) to the host: `where` = "device" (the rest)
    or "host" (those)."""
    m, s, every, sp = cfg.model, layout.seq(cfg.train.seq_len), cfg.train.ac_every, sequence_parallel(cfg, layout)
    n = numerics(cfg.precision.name, layout)
    if layout.pp > 1:
        n_mb, virtual, schedule, _ = pipeline(cfg)
        mb = max(1, b * cfg.train.grad_accum // n_mb)
        n_stages = layout.pp * virtual
        per_rank = []
        for r, stages in enumerate(stage_ranks(cfg, layout)):
            total = 0
            for k, (first, end, emb, last) in enumerate(stages):
                stage = r + k * layout.pp
                in_flight = n_mb if schedule == "gpipe" else min(n_mb, n_stages - stage)
                total += _split(
                    where,
                    cfg,
                    M.activation_bytes(
                        m,
                        mb,
                        s,
                        n,
                        ac,
                        every,
                        layers=end - first,
                        tp=layout.tp,
                        with_head=last,
                        with_embedding=emb,
                        in_flight=in_flight,
                        first_layer=first,
                        sp=sp,
                    ),
                    _offloaded(m, mb, s, n, ac, every, end - first, layout.tp, in_flight, first, sp=sp),
                )
                total += in_flight * M.document_mask(cfg, mb, s, n) if where == "device" else 0
            per_rank.append(total)
        return max(per_rank) if pp_rank is None else per_rank[pp_rank]
    return _split(
        where,
        cfg,
        M.activation_bytes(
            m, b, s, n, ac, every, tp=layout.tp, loss_chunks=loss_slices(cfg, layout, b), cp=layout.cp, sp=sp
        )
        + lora_activations(cfg, layout, ac, b, n)
        + moe.activation_delta(m, M.Shape.of(m, b, s), n, ac, every, layout.ep),
        _offloaded(m, b, s, n, ac, every, m.n_layers, layout.tp, 1, 0, layout.cp, sp),
    ) + (M.document_mask(cfg, b, s, n) if where == "device" else 0)


def lora_activations(cfg: Config, layout: Layout, ac: ACMode, b: int, n: M.Numerics) -> int:
    """model.lora (launcher/planner/lora.py): in the blocks that keep their activations."""
    m = cfg.model
    if not lora.enabled(m):
        return 0
    s, kept = layout.seq(cfg.train.seq_len), m.n_layers - M.recomputed(m.n_layers, ac, cfg.train.ac_every)
    copies = M.weight_copies(M.Shape.of(m, b, s), n, kept, True, layout.tp, loss_slices(cfg, layout, b))
    return lora.activation_delta(m, cfg.precision.name, b, s, n, kept, copies)


def _split(where: str, cfg: Config, total: int, offloaded: int) -> int:
    if not cfg.train.activation_offload:
        return total if where == "device" else 0
    return total - offloaded if where == "device" else offloaded


def sequence_parallel(cfg: Config, layout: Layout) -> bool:
    """parallel.sequence_parallel, where it acts: under tensor parallel."""
    return layout.tp > 1 and cfg.parallel.sequence_parallel


def _offloaded(
    m: ModelConfig,
    b: int,
    s: int,
    n,
    ac: ACMode,
    every: int,
    layers: int,
    tp: int,
    in_flight: int,
    first: int,
    cp: int = 1,
    sp: bool = False,
) -> int:
    """What train.activation_offload moves: the kept blocks' activations and the recomputed
    blocks' inputs (checkpoint saves them through autograd too), for each micro-batch in
    flight, and the kept blocks' weight copies (made once a step). Not op-level
    recomputation's matmul outputs: its policy keeps them itself, on the device."""
    x = M.Shape.of(m, b, s)
    r = M.recomputed(layers, ac, every, first)
    copies = n.compute * (layers - r) * x.block_params // tp if n.autocast else 0  # not FSDP's gathered weights
    kept_input = n.residual * x.b * x.s * x.h // (tp if sp else 1)
    return in_flight * ((layers - r) * M.block_activations(x, n, tp, cp, sp) + r * kept_input) + copies


def loss_slices(cfg: Config, layout: Layout, b: int) -> int:
    """train.loss_chunks as this layout runs it on micro-batch b (1 on a pipeline, under
    tensor parallel and for model=hf: launcher/config/derived.py::loss_chunks)."""
    return loss_chunks(cfg, cfg.model.vocab_size, b, sliceable_loss(cfg, layout.pp, layout.tp))


def temporaries(
    m: ModelConfig,
    precision: Precision,
    layout: Layout,
    ac: ACMode,
    ac_every: int,
    b: int,
    s: int,
    loss_chunks: int = 1,
    sp: bool = False,
    gathered: int | None = None,
) -> int:
    """Transient buffers at the step's peak: the logits while the loss runs (whole, or one
    slice of `loss_chunks`: M.loss_temporaries; whole on every tensor-parallel rank), one block's activations while it is recomputed,
    ZeRO-3/FSDP's gathered layers (the current and the prefetched one, 16-bit; fp32 in an fp32 run), and under
    FSDP an untied embedding: the root unit is held gathered through forward and backward
    (launcher/parallel/mesh.py::apply_fsdp), and autograd saves the head's weight
    (activations count it: Numerics.gathered_head) but not the embedding's."""
    n = numerics(precision, layout)
    x = M.Shape.of(m, b, s)
    # Tensor parallel gathers the head's output (launcher/parallel/cuts.py: ColwiseParallel to
    # Replicate): every rank holds the whole vocabulary's logits, not a 1/tp slice.
    logits = M.loss_temporaries(x, n, loss_chunks)
    recompute = (
        M.block_activations(x, n, layout.tp, layout.cp, sp) + moe.recompute_delta(m, x, n, layout.ep)
        if M.recomputed(x.L, ac, ac_every)
        else 0
    )
    # (a pipeline's FSDP stages hold all their layers gathered: pipeline_unsharded; model.moe: the largest block)
    # (DeepSpeed: `gathered` elements, zero.gathered: its prefetch and max-live settings)
    block = x.block_params + moe.largest_block_delta(m, layout.ep)
    w = 4 if precision == Precision.fp32 else 2  # the gathered weights' dtype: fp32 in an fp32 run (ds_weight_bytes)
    held = w * (2 * block // layout.tp if gathered is None else gathered)
    gathered = held if layout.shard == "zero3" and not pipelined_fsdp(layout) else 0
    embedding = n.compute * x.V * x.h // layout.tp if layout.fsdp and not m.tie_embeddings else 0
    return logits + recompute + gathered + embedding


def pipelined_fsdp(layout: Layout) -> bool:
    return layout.fsdp and layout.pp > 1


def pipeline_unsharded(cfg: Config, layout: Layout, ac: ACMode, pp_rank: int | None = None) -> int:
    """pp x FSDP (recipe pp_fsdp): torch.distributed.pipelining holds FSDP's reduce-scatter
    and resharding back until the step's last micro-batch has run backward, so from the
    first backward to the end of the schedule a rank holds its stages' parameters gathered
    (compute dtype) and their gradients unsharded in fp32: (c + 4) bytes for each parameter
    of its stages, split only by tensor parallel, less the gathered weights that autograd
    saves and the activations count (blocks that do not recompute, the head:
    M.weight_copies); the worst rank, or pipeline rank `pp_rank`. 0 for every other layout."""
    if not pipelined_fsdp(layout):
        return 0
    n, x, every = numerics(cfg.precision.name, layout), M.Shape.of(cfg.model, 1, cfg.train.seq_len), cfg.train.ac_every
    per_rank = []
    for r, stages in enumerate(stage_ranks(cfg, layout)):
        saved = sum(
            M.weight_copies(x, n, (end - first) - M.recomputed(end - first, ac, every, first), last, layout.tp)
            for first, end, _, last in stages
        )
        per_rank.append((n.compute + 4) * param_share(cfg, layout, r) - saved)
    return max(per_rank) if pp_rank is None else per_rank[pp_rank]

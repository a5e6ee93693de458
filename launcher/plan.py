"""`make plan`: predict every layout's memory per GPU before launch, recommend what fits.

For each candidate layout (recipe and degrees) and activation-checkpointing mode, find
the largest micro-batch whose predicted peak fits the GPU, then estimate the step's
relative cost. The recommended row is the cheapest time per token among those that
fit. The formulas are launcher/memory.py's; docs/memory.md derives them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from launcher import ds_config, jsonout
from launcher import memory as M
from launcher.config import ACMode, Config, ConfigError, ModelConfig, ModelKind, Precision
from launcher.models.gpt import flops_per_token

GiB = 2**30
DEFAULT_TFLOPS = 989.0  # H100 SXM dense bf16


@dataclass(frozen=True)
class Layout:
    """A recipe and its degrees. `shard` says how model states split over the
    data-parallel ranks: none (replicated), zero1, zero2, zero3 (ZeRO-3 and FSDP)."""

    recipe: str
    dp: int
    tp: int = 1
    pp: int = 1
    shard: str = "none"
    offload_optim: bool = False
    offload_params: bool = False
    fsdp: bool = False

    @property
    def label(self) -> str:
        degrees = [f"dp{self.dp}"] + ([f"tp{self.tp}"] if self.tp > 1 else []) + ([f"pp{self.pp}"] if self.pp > 1 else [])
        return f"{self.recipe} ({' '.join(degrees)})"

    def overrides(self) -> list[str]:
        out = [f"recipe={self.recipe}"]
        if self.tp > 1:
            out.append(f"parallel.tp={self.tp}")
        if self.pp > 1:
            out.append(f"parallel.pp={self.pp}")
        return out


@dataclass
class Row:
    layout: Layout
    ac: ACMode
    micro_batch: int
    """The largest that fits (or 1 when nothing fits)."""
    fits: bool
    params: int
    grads: int
    optim: int
    activations: int
    temp: int
    where: dict[str, str]
    host: dict[str, int] = dataclasses.field(default_factory=dict)
    """The part of params/grads/optim kept in host memory (offload): not counted in total."""
    step_time_s: float = math.nan
    tokens_per_step: int = 0
    cost: float = math.nan
    """Time per token relative to the recommended row (1.0 = the cheapest)."""
    recommended: bool = False
    startup: int = 0
    """Device bytes one rank holds when its engine is ready, before step 1 (start_up())."""
    startup_host_node: int = 0
    """Host bytes the ranks of one node hold then, beyond their processes' baseline."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optim - sum(self.host.values()) + self.activations + self.temp

    @property
    def peak(self) -> int:
        """What the device must hold: the training step's total, or start-up when it is larger."""
        return max(self.total, self.startup)


@dataclass
class Hardware:
    gpu_bytes: int
    gpus_per_node: int
    nnodes: int
    tflops: float
    host_bytes: int | None = None
    """Host memory of one node (plan.host_memory_gb); None: start-up's host bytes are shown, not checked."""

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nnodes


# ----------------------------------------------------------------------------- states
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
    has head) -- launcher.models.parallel.stage_bounds, as the pp recipe cuts them."""
    from launcher.models.parallel import stage_bounds

    _, virtual, _, split = pipeline(cfg)
    n_stages = layout.pp * virtual
    bounds = stage_bounds(cfg.model, n_stages, split)
    return [[(*bounds[s], s == 0, s == n_stages - 1) for s in range(r, n_stages, layout.pp)]
            for r in range(layout.pp)]


def param_share(cfg: Config, layout: Layout, pp_rank: int | None = None) -> int:
    """Parameters one rank holds before data-parallel sharding: pipeline rank `pp_rank`,
    or the worst rank."""
    m = cfg.model
    c = M.ParamCounts.of(m)
    if layout.pp > 1:
        # The first stage holds the embedding, the last the final norm and the head (a
        # tied head is a copy there).
        head = c.embed if m.tie_embeddings else c.head
        shares = [sum((end - first) * c.block + (c.embed if emb else 0) + (head + c.final_norm if last else 0)
                      for first, end, emb, last in stages) for stages in stage_ranks(cfg, layout)]
        return max(shares) if pp_rank is None else shares[pp_rank]
    if layout.tp > 1:
        # The matrices are split; the norms are replicated; so is a tied embedding (one
        # parameter shared with the head), while an untied embedding and head split by
        # vocabulary.
        norms = (2 * c.n_blocks + 1) * m.dim
        matrices = c.n_blocks * (c.block - 2 * m.dim)
        ends = c.embed if m.tie_embeddings else (c.embed + c.head) // layout.tp
        return matrices // layout.tp + norms + ends
    return c.total


def model_states(cfg: Config, layout: Layout,
                 pp_rank: int | None = None) -> tuple[int, int, int, dict[str, str], dict[str, int]]:
    """(params, grads, optimizer) bytes on one rank, where each lives (device, cpu or
    device+cpu) and how many of them are in host memory (offload).

    DDP, TP and PP under autocast keep fp32 parameters and gradients (4 + 4 + 8 bytes per
    parameter with Adam). FSDP2 with a bf16 MixedPrecisionPolicy shards fp32 parameters,
    fp32 gradients and the moments (16 per parameter, all sharded). DeepSpeed holds what
    launcher.memory.zero_states says, measured in every precision: the ZeRO paper's terms
    with w-byte weights (w = 2, or 4 in fp32), plus an fp32 copy of the gradient shard and
    an fp32 master shard even in fp32, with offload splitting parts to the host.
    """
    P = param_share(cfg, layout, pp_rank)
    precision = cfg.precision.name
    n = layout.dp
    where = {"params": "device", "grads": "device", "optim": "device"}
    host = {"params": 0, "grads": 0, "optim": 0}
    if layout.shard == "none":
        params, grads, optim = 4 * P, 4 * P, 8 * P
    elif layout.fsdp:
        params, grads, optim = 4 * P // n, 4 * P // n, 8 * P // n
    else:
        parts = M.zero_states(int(layout.shard[-1]), P, n, cfg.train.grad_accum, layout.offload_optim,
                              layout.offload_params, largest_param=M.largest_param(cfg.model),
                              weight_bytes=4 if precision == Precision.fp32 else 2,
                              straddle=M.straddling(cfg.model, n),
                              kept_whole=M.persistent(cfg.model, ds_config.persistence_threshold(cfg)),
                              bucket=ds_config.reduce_bucket(cfg))
        params, grads, optim = (int(d + h) for d, h in parts.values())
        for k, (d, h) in parts.items():
            host[k] = int(h)
            where[k] = "cpu" if not d else ("device+cpu" if h else "device")
    return params, grads, optim, where, host


# ----------------------------------------------------------------------------- start-up
def start_up(cfg: Config, layout: Layout) -> tuple[int, int]:
    """(device bytes, host bytes) one rank holds when its engine is ready, before step 1:
    the model is built on the meta device and each rank allocates only its part
    (launcher/models/init.py); what the engine adds before the first step is the recipe's
    own. P is what the rank holds before data-parallel sharding (param_share), Ψ the
    whole model, w the bytes of DeepSpeed's weights (2 in bf16/fp16, 4 in fp32), n the
    data-parallel size. docs/memory.md derives each line; tests/test_startup.py measures them.

      ddp                4P weights + 4P DDP's gradient buckets (allocated at construction)
      tp, pp             4P weights (Adam's moments appear in the first step)
      fsdp, tp_fsdp      4P/n weight shards (cpu_offload: in host memory)
      zero1, zero2       wΨ weights + 4Ψ/n fp32 master shard + 4Ψ/n fp32 gradient shard
                         (DeepSpeed's optimizer set-up)
      zero2_offload      device: wΨ weights + wΨ/n upload copy of the shard + wL copy buffer;
                         host: 4Ψ/n master + 4Ψ/n fp32 gradient shard + wL copy buffer
      zero3              wΨ/n weight partition + wΨ/n gradient partitions + 4Ψ/n master
                         + 4Ψ/n the set-up's gradient buffer
      zero3_offload      host: all of zero3's + 4Ψ/n the fp32 gradients of the CPU update
    (L: the largest parameter's elements.) Reading model.pretrained adds at most one 16 MiB
    chunk per rank (launcher/models/weights.py)."""
    P = param_share(cfg, layout)
    n = layout.dp
    psi = M.ParamCounts.of(cfg.model).total
    w = 4 if cfg.precision.name == Precision.fp32 else 2
    if layout.shard == "none":
        return (8 if layout.recipe == "ddp" else 4) * P, 0
    if layout.fsdp:
        shard = 4 * P // n
        offload = getattr(getattr(cfg.recipe, "fsdp", None), "cpu_offload", False) and layout.recipe == cfg.recipe.name
        return (0, shard) if offload else (shard, 0)
    if layout.shard in ("zero1", "zero2"):
        if layout.offload_optim:
            largest = w * M.largest_param(cfg.model)
            return w * psi + w * psi // n + largest, 8 * psi // n + largest
        return w * psi + 8 * psi // n, 0
    weights, grads, optimizer = w * psi // n, w * psi // n, 8 * psi // n
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
        return dataclasses.replace(M.Numerics.of(precision.value, low_precision_params=True), gathered_head=True)
    return M.Numerics.of(precision.value)


def activations(cfg: Config, layout: Layout, ac: ACMode, b: int, pp_rank: int | None = None) -> int:
    """Saved activations on pipeline rank `pp_rank`, or the worst rank.

    A pipeline cuts each data-parallel rank's batch (b x grad_accum sequences) into
    parallel.pp_microbatches; a stage keeps the activations of every micro-batch it has
    run forward but not yet backward: all of them under GPipe, pp - s for stage s under
    1F1B (interleaved: the same rule over the virtual stages)."""
    m, s, every = cfg.model, cfg.train.seq_len, cfg.train.ac_every
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
                total += M.activation_bytes(m, mb, s, n, ac, every, layers=end - first, with_head=last,
                                            with_embedding=emb, in_flight=in_flight, first_layer=first)
            per_rank.append(total)
        return max(per_rank) if pp_rank is None else per_rank[pp_rank]
    return M.activation_bytes(m, b, s, n, ac, every, tp=layout.tp)


def temporaries(m: ModelConfig, precision: Precision, layout: Layout, ac: ACMode, ac_every: int, b: int, s: int) -> int:
    """Transient buffers at the step's peak: the logits (low-precision output and the
    fp32 copy the loss takes), one block's activations while it is recomputed, and
    ZeRO-3/FSDP's gathered layers (the current and the prefetched one, bf16)."""
    n = numerics(precision, layout)
    x = M.Shape.of(m, b, s)
    logits = (n.compute + 4) * b * s * x.V // layout.tp
    recompute = M.block_activations(x, n, layout.tp) if M.recomputed(x.L, ac, ac_every) else 0
    gathered = 2 * 2 * x.block_params // layout.tp if layout.shard == "zero3" else 0
    return logits + recompute + gathered


# ----------------------------------------------------------------------------- cost
def step_time(cfg: Config, hw: Hardware, layout: Layout, ac: ACMode, b: int) -> tuple[float, int]:
    """Seconds per optimizer step and tokens per step, for the global batch this
    micro-batch gives with the configured accumulation."""
    p = cfg.plan
    m, s = cfg.model, cfg.train.seq_len
    accum = cfg.train.grad_accum
    tokens = b * accum * layout.dp * s
    recompute = 1 + (2 / 6) * M.recomputed(m.n_layers, ac, cfg.train.ac_every) / m.n_layers
    flops = tokens * flops_per_token(m, s) * recompute / (layout.dp * layout.tp * layout.pp)
    compute = flops / (hw.tflops * 1e12 * p.mfu)
    if layout.pp > 1:  # the pipeline bubble: (pp - 1) idle micro-batch slots per step
        compute *= (accum + layout.pp - 1) / accum

    def bandwidth(group: int, spans_nodes: bool) -> float:
        return (p.inter_node_gbps if spans_nodes else p.intra_node_gbps) * 1e9

    P = param_share(cfg, layout)
    dp_spans = layout.dp * layout.tp * layout.pp > hw.gpus_per_node
    ring = 2 * (layout.dp - 1) / layout.dp if layout.dp > 1 else 0.0
    if layout.shard in ("zero3",):
        volume = 1.5 * ring * 2 * P  # all-gather forward and backward, reduce-scatter grads
    elif layout.shard in ("zero1", "zero2"):
        volume = ring * 2 * P  # reduce-scatter bf16 grads, all-gather bf16 params
    else:
        volume = ring * 4 * P  # all-reduce fp32 grads
    comm = volume / bandwidth(layout.dp, dp_spans)
    if layout.tp > 1:  # 4 all-reduces of b*s*h activations per layer per micro-batch
        act = b * s * m.dim * numerics(cfg.precision.name, layout).compute
        comm += accum * m.n_layers / layout.pp * 4 * (2 * (layout.tp - 1) / layout.tp) * act / bandwidth(layout.tp, False)
    if layout.pp > 1:  # activations forward and gradients back across each boundary
        comm += accum * 2 * b * s * m.dim * numerics(cfg.precision.name, layout).compute / bandwidth(2, dp_spans)
    offload = 0.0
    if layout.offload_optim:
        shard = P / layout.dp
        offload += (4 * shard + 2 * shard) / (p.pcie_gbps * 1e9) + shard / p.cpu_adam_params_per_s
    if layout.offload_params:
        offload += 2 * 2 * (P / layout.dp) / (p.pcie_gbps * 1e9)
    return compute + comm + offload, tokens


# ----------------------------------------------------------------------------- candidates
def candidates(cfg: Config, hw: Hardware, available: set[str]) -> list[Layout]:
    """Every layout of the landed recipes that divides this world."""
    m, world = cfg.model, hw.world
    kv = m.n_kv_heads or m.n_heads
    out: list[Layout] = []
    add = lambda layout: out.append(layout) if layout.recipe in available else None  # noqa: E731
    add(Layout("ddp", dp=world))
    add(Layout("zero1", dp=world, shard="zero1"))
    add(Layout("zero2", dp=world, shard="zero2"))
    add(Layout("zero3", dp=world, shard="zero3"))
    add(Layout("zero2_offload", dp=world, shard="zero2", offload_optim=True))
    add(Layout("zero3_offload", dp=world, shard="zero3", offload_optim=True, offload_params=True))
    add(Layout("fsdp", dp=world, shard="zero3", fsdp=True))
    for t in (2, 4, 8):
        if world % t or t > hw.gpus_per_node or m.n_heads % t or kv % t:
            continue
        add(Layout("tp", dp=world // t, tp=t))
        add(Layout("tp_fsdp", dp=world // t, tp=t, shard="zero3", fsdp=True))
    for pp in (2, 4):
        if world % pp == 0 and pp <= m.n_layers:
            add(Layout("pp", dp=world // pp, pp=pp))
    return out


def layout_for(cfg: Config, world: int) -> Layout:
    """The layout a composed config runs: its recipe with its degrees on `world` ranks."""
    tp = getattr(getattr(cfg, "parallel", None), "tp", 1) or 1
    pp = getattr(getattr(cfg, "parallel", None), "pp", 1) or 1
    hw = Hardware(gpu_bytes=0, gpus_per_node=world, nnodes=1, tflops=DEFAULT_TFLOPS)
    for layout in candidates(cfg, hw, {cfg.recipe.name}):
        if layout.tp == tp and layout.pp == pp:
            return layout
    raise ValueError(f"the planner has no layout for recipe {cfg.recipe.name} (tp={tp}, pp={pp}) on {world} ranks")


def memory_row(cfg: Config, layout: Layout, ac: ACMode, b: int, hw: Hardware | None = None) -> Row:
    params, grads, optim, where, host = model_states(cfg, layout)
    act = activations(cfg, layout, ac, b)
    tmp = temporaries(cfg.model, cfg.precision.name, layout, ac, cfg.train.ac_every, b, cfg.train.seq_len)
    device, host_rank = start_up(cfg, layout)
    per_node = min(hw.gpus_per_node, hw.world) if hw is not None else 1
    return Row(layout=layout, ac=ac, micro_batch=b, fits=False, params=params, grads=grads, optim=optim,
               activations=act, temp=tmp, where=where, host=host, startup=device,
               startup_host_node=host_rank * per_node)


def fits(cfg: Config, hw: Hardware, row: Row) -> bool:
    """The step and the start-up both fit the GPU (less plan.reserve_gb), and start-up fits
    the node's host memory when it is known: a layout that cannot start never fits."""
    budget = hw.gpu_bytes - int(cfg.plan.reserve_gb * GiB)
    return row.peak <= budget and (hw.host_bytes is None or host_per_node(row, hw) <= hw.host_bytes)


def host_per_node(row: Row, hw: Hardware) -> int:
    """Host bytes the ranks of a node need: start-up's, or the offloaded states of the step."""
    return max(row.startup_host_node, sum(row.host.values()) * min(hw.gpus_per_node, hw.world))


def largest_fitting(cfg: Config, hw: Hardware, layout: Layout, ac: ACMode) -> Row:
    """Binary search on the micro-batch: memory grows with it, monotonically."""
    fits_at = lambda b: fits(cfg, hw, memory_row(cfg, layout, ac, b, hw))  # noqa: E731
    if not fits_at(1):
        return memory_row(cfg, layout, ac, 1, hw)
    lo, hi = 1, 2
    while hi <= cfg.plan.max_micro_batch and fits_at(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, cfg.plan.max_micro_batch + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits_at(mid) else (lo, mid)
    row = memory_row(cfg, layout, ac, lo, hw)
    row.fits = True
    return row


def plan(cfg: Config, hw: Hardware, available: set[str], micro_batch: int | None = None) -> list[Row]:
    """One row per layout x activation-checkpointing mode. With `micro_batch` given the
    rows are for that micro-batch; otherwise each row has its largest fitting one."""
    cfg = planned_model(cfg)
    rows = []
    for layout in candidates(cfg, hw, available):
        for ac in (ACMode.none, ACMode.selective, ACMode.full):
            if micro_batch is None:
                row = largest_fitting(cfg, hw, layout, ac)
            else:
                row = memory_row(cfg, layout, ac, micro_batch, hw)
                row.fits = fits(cfg, hw, row)
            row.step_time_s, row.tokens_per_step = step_time(cfg, hw, layout, ac, row.micro_batch)
            rows.append(row)
    fitting = [r for r in rows if r.fits]
    if fitting:
        best = min(fitting, key=lambda r: r.step_time_s / r.tokens_per_step)
        best.recommended = True
        unit = best.step_time_s / best.tokens_per_step
        for r in rows:
            r.cost = (r.step_time_s / r.tokens_per_step) / unit
    return rows


def planned_model(cfg: Config) -> Config:
    """model=hf: the project decoder of the same shape (launcher.models.hf.gpt_shape), whose
    formulas hold exactly for a Llama-layout model (its meta-device parameter count is
    checked equal). Any other model type is refused: the activation formulas would give
    wrong numbers for it."""
    if cfg.model.kind != ModelKind.hf:
        return cfg
    from launcher.models import hf

    shape = hf.gpt_shape(cfg.model)
    params = hf.structure(cfg.model).num_params()
    if not hf.is_llama_like(cfg.model) or M.ParamCounts.of(shape).total != params:
        raise ConfigError("model", f"hf ({shape.name})", f"not a Llama-layout decoder ({params:,} parameters): the "
                          "planner's memory formulas (docs/memory.md) do not apply; choose the recipe and micro-batch by hand")
    return dataclasses.replace(cfg, model=shape)


def recommended(rows: list[Row]) -> Row | None:
    return next((r for r in rows if r.recommended), None)


def no_fit_message(rows: list[Row], hw: Hardware, reserve_gb: float) -> str:
    smallest = min(rows, key=lambda r: r.peak)
    need = smallest.peak / GiB + reserve_gb
    what = "at start-up" if smallest.startup > smallest.total else "at micro-batch 1"
    return (f"nothing fits in {hw.gpu_bytes / GiB:.0f} GiB per GPU on {hw.world} GPU(s): the smallest is "
            f"{smallest.layout.label} with activation checkpointing {smallest.ac.value} {what}, "
            f"{smallest.peak / GiB:.1f} GiB + {reserve_gb:g} GiB reserve; it needs GPUs with at least "
            f"{math.ceil(need)} GiB, or more GPUs, or a shorter train.seq_len")


# ----------------------------------------------------------------------------- output
def to_json(rows: list[Row], hw: Hardware) -> str:
    def row(r: Row) -> dict:
        d = asdict(r)
        d["layout"] = asdict(r.layout) | {"label": r.layout.label, "overrides": r.layout.overrides()}
        d["ac"] = r.ac.value
        d["total"] = r.total
        d["peak"] = r.peak
        d["headroom"] = hw.gpu_bytes - r.peak
        return d

    return jsonout.dumps({"gpu_bytes": hw.gpu_bytes, "world": hw.world, "rows": [row(r) for r in rows]}, indent=1)


def table(rows: list[Row], hw: Hardware, title: str):
    from rich.table import Table

    t = Table(title=title, show_lines=False)
    for col in ("", "layout", "AC", "micro-batch", "params", "grads", "optim", "activations", "temp", "total",
                "start-up", "host/node", "headroom", "cost"):
        t.add_column(col, justify="left" if col in ("layout", "AC", "") else "right")
    gb = lambda v: f"{v / GiB:,.2f}"  # noqa: E731
    for r in rows:
        mark = "★" if r.recommended else ("" if r.fits else "✗")
        place = lambda k, v: gb(v) + ("*" if r.host.get(k) else "")  # noqa: E731
        t.add_row(mark, r.layout.label, r.ac.value, str(r.micro_batch) if r.fits else "-",
                  place("params", r.params), place("grads", r.grads), place("optim", r.optim), gb(r.activations),
                  gb(r.temp), gb(r.total), gb(r.startup), gb(r.startup_host_node), gb(hw.gpu_bytes - r.peak),
                  f"{r.cost:.2f}" if r.fits else "-",
                  style="bold green" if r.recommended else (None if r.fits else "dim"))
    t.caption = ("GiB per GPU. * = (partly) in host memory (offload); the host part is not counted in total. start-up = "
                 "held when the engine is ready, before step 1; host/node = host memory of one node's ranks then; "
                 "headroom = GPU memory less the larger of total and start-up. cost = time per token relative "
                 "to ★, the recommended row (the cheapest that fits). ✗ = does not fit even at micro-batch 1, or cannot start.")
    return t


def chart(rows: list[Row], hw: Hardware, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.layout.label}\n{r.ac.value} mb={r.micro_batch}" for r in rows]
    parts = [("params", lambda r: r.params - r.host.get("params", 0)),
             ("grads", lambda r: r.grads - r.host.get("grads", 0)),
             ("optim", lambda r: r.optim - r.host.get("optim", 0)),
             ("activations", lambda r: r.activations), ("temp", lambda r: r.temp)]
    fig, ax = plt.subplots(figsize=(max(8, 0.5 * len(rows)), 6))
    bottom = [0.0] * len(rows)
    for name, get in parts:
        values = [get(r) / GiB for r in rows]
        ax.bar(range(len(rows)), values, bottom=bottom, label=name)
        bottom = [a + b for a, b in zip(bottom, values)]
    ax.axhline(hw.gpu_bytes / GiB, color="red", linestyle="--", label="GPU memory")
    ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=7)
    ax.set_ylabel("GiB per GPU")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

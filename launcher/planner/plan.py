"""`make plan`: predict every layout's memory per GPU before launch, recommend what fits.

For each candidate layout (recipe and degrees) and activation-checkpointing mode, find
the largest micro-batch whose predicted peak fits the GPU, then estimate the step's
relative cost. The recommended row is the cheapest time per token among those that
fit. The formulas are launcher/planner/memory.py's; docs/memory.md derives them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass

from rich.table import Table

import engines
from launcher import jsonout, optim
from launcher.config import ACMode, Config, ConfigError, ModelKind, RecipeConfig
from launcher.models import hf
from launcher.parallel import degrees as D
from launcher.parallel import ds_config
from launcher.planner import collectives, lora, moe
from launcher.planner import gathered as G
from launcher.planner import memory as M
from launcher.planner import zero as Z
from launcher.planner.cost import step_time
from launcher.planner.footprint import (
    Layout,
    activations,
    grads_at_peak,
    grads_kept,
    loss_slices,
    model_states,
    numerics,
    pipeline,
    pipeline_unsharded,
    sequence_parallel,
    start_up,
    temporaries,
)

GiB = 2**30
DEFAULT_TFLOPS = 989.0  # H100 SXM dense bf16


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
    """The part of params/grads/optim kept in host memory (offload): not counted in total;
    and "activations", what train.activation_offload moves (`activations` is the rest)."""
    step_time_s: float = math.nan
    tokens_per_step: int = 0
    cost: float = math.nan
    """Time per token relative to the recommended row (1.0 = the cheapest)."""
    recommended: bool = False
    startup: int = 0
    """Device bytes one rank holds when its engine is ready, before step 1 (start_up())."""
    startup_host_node: int = 0
    """Host bytes the ranks of one node hold then, beyond their processes' baseline."""

    grads_kept: int = 0
    """Device bytes of gradients alive with the forward's activations (footprint.grads_kept):
    all where the engine keeps them between steps or accumulates them, less where backward
    makes them as it frees the activations (Layout.grads_freed, one micro-batch a step)."""
    grads_peak: int = 0
    """Device bytes of gradients at their own peak, the activations gone (the end of backward,
    the update; footprint.grads_at_peak): the device gradients, or more for transient copies."""
    collectives: dict = dataclasses.field(default_factory=dict)  # one step's, one rank: collectives.per_step
    why_not: str = ""  # why the row does not fit, in words
    gathered: dict = dataclasses.field(default_factory=dict)  # ZeRO-3's / FSDP's working set: G.of_layout
    dispatch_worst: int = 0  # model.moe under ep, no capacity factor: what the worst routing adds (moe.worst_extra)

    @property
    def grads_split(self) -> tuple[int, int]:
        """(device gradients beside the activations, how many more their own peak needs):
        with the activations they add up to max(grads at peak, kept + activations)."""
        grads = self.grads - self.host.get("grads", 0)
        kept = min(self.grads_kept, grads)
        return kept, max(0, max(self.grads_peak, grads) - kept - self.activations)

    @property
    def total(self) -> int:
        kept, beyond = self.grads_split
        return (
            self.params
            + self.optim
            - self.host.get("params", 0)
            - self.host.get("optim", 0)
            + kept
            + self.activations
            + beyond
            + self.temp
        )

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
    cpu: bool = False
    """The ranks are processes on this machine's CPU: gpu_bytes is each one's share of its memory."""

    @property
    def unit(self) -> str:
        """What one rank's memory is: a GPU's, or a CPU process's share."""
        return "process" if self.cpu else "GPU"

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nnodes


# ----------------------------------------------------------------------------- candidates
TP_DEGREES = (2, 4, 8)
PP_DEGREES = (2, 4)


def candidates(cfg: Config, hw: Hardware, available: dict[str, RecipeConfig]) -> list[Layout]:
    """Every layout of the given recipes (name -> its recipe config, conf/recipe/*.yaml)
    that divides this world: each engine's EngineSpec says which degrees it may use and how
    it holds model states (its `holds`: the formula this planner applies). Data-parallel
    layouts first, then tensor parallel by degree, then pipeline by degree (and tensor
    parallel inside the stages where the recipe may: pp x tp, pp x tp x fsdp). An MoE runs under
    neither tensor nor pipeline parallel; its ep degrees: launcher/planner/moe.py::ep_degrees."""
    m, world = cfg.model, hw.world
    kv = m.n_kv_heads or m.n_heads
    out: list[tuple[tuple, Layout]] = []
    for name, rc in available.items():
        spec = engines.spec(rc.engine)
        h, can = spec.holds(rc), spec.parallelism
        held = holding(rc)
        # Ties (the same step time) go to the first: replicated before sharded, ZeRO's stages
        # in order before FSDP (the same states), offload last.
        order = (h.offload_optim or h.offload_params, h.shard, h.fsdp, name)
        # parallel.cp is the user's (a long sequence's): kept by the recipes that split the sequence
        cp = cfg.parallel.cp if can.cp else 1
        if cfg.train.seq_len % cp or world % cp:
            continue
        if not (can.tp or can.pp) and m.n_heads % cp == 0:
            out += [
                ((0, 0, 0, *order, ep), Layout(name, dp=world // cp, cp=cp, ep=ep, **held))
                for ep in moe.ep_degrees(cfg, hw.world, hw.gpus_per_node, can.ep)
            ]
        tps = ((1,) if "tp" not in can.required else ()) + (TP_DEGREES if can.tp else ())
        pps = ((1,) if "pp" not in can.required else ()) + (PP_DEGREES if can.pp else ())
        for pp in pps:
            for t in tps:
                if (
                    t == pp == 1
                    or world % (t * pp * cp)
                    or t > hw.gpus_per_node
                    or m.n_heads % t
                    or kv % t
                    or moe.enabled(m)
                ):
                    continue
                if (m.n_heads // t) % cp:
                    continue
                if pp > m.n_layers or (pp > 1 and h.fsdp and world // (t * pp) == 1):
                    continue  # a pipeline whose stages have no ranks to shard over is recipe=pp
                out.append(
                    (
                        (1 if pp == 1 else 2, pp, t, *order, 1),
                        Layout(name, dp=world // (t * pp * cp), tp=t, pp=pp, cp=cp, **held),
                    )
                )
    return [layout for _, layout in sorted(out, key=lambda kv_: kv_[0])]


def holding(rc: RecipeConfig) -> dict:
    """A Layout's fields for how the recipe holds model states (its spec's `holds`)."""
    h = engines.spec(rc.engine).holds(rc)
    return dict(
        shard=h.shard,
        fsdp=h.fsdp,
        offload_optim=h.offload_optim,
        offload_params=h.offload_params,
        grad_buckets=h.grad_buckets,
        grads_freed=h.grads_freed,
    )


def layout_of(cfg: Config, deg) -> Layout:
    """The layout of a composed config at resolved degrees (launcher.parallel.degrees):
    any degree the recipe allows, not only those `make plan` compares (make rehearse)."""
    return Layout(
        cfg.recipe.name, dp=deg.dp, tp=deg.tp, pp=deg.pp, cp=deg.cp, ep=getattr(deg, "ep", 1), **holding(cfg.recipe)
    )  # (Degrees.ep: with expert parallel in the recipes)


def layout_for(cfg: Config, world: int) -> Layout:
    """The layout a composed config runs: its recipe with its degrees on `world` ranks."""
    return layout_of(cfg, D.degrees(cfg, world))


def memory_row(cfg: Config, layout: Layout, ac: ACMode, b: int, hw: Hardware | None = None) -> Row:
    params, grads, optim, where, host = model_states(cfg, layout)
    act = activations(cfg, layout, ac, b)
    if cfg.train.activation_offload:  # in host memory, beside the offloaded model states
        host = {**host, "activations": activations(cfg, layout, ac, b, where="host")}
    # A pipeline runs the loss and a recomputation on one of its micro-batches at a time
    # (b x grad_accum sequences cut into parallel.pp_microbatches), the others on b.
    at_once = b if layout.pp == 1 else max(1, b * cfg.train.grad_accum // pipeline(cfg)[0])
    tmp = temporaries(
        cfg.model,
        cfg.precision.name,
        layout,
        ac,
        cfg.train.ac_every,
        at_once,
        layout.seq(cfg.train.seq_len),
        loss_slices(cfg, layout, b),
        sequence_parallel(cfg, layout),
        deepspeed_gathered(cfg, layout),
    ) + pipeline_unsharded(cfg, layout, ac)
    device, host_rank = start_up(cfg, layout)
    per_node = min(hw.gpus_per_node, hw.world) if hw is not None else 1
    return Row(
        layout=layout,
        ac=ac,
        micro_batch=b,
        fits=False,
        params=params,
        grads=grads,
        optim=optim,
        activations=act,
        temp=tmp,
        where=where,
        host=host,
        startup=device,
        startup_host_node=host_rank * per_node,
        grads_kept=grads_kept(cfg, layout, grads - host["grads"]),
        grads_peak=grads_at_peak(cfg, layout, grads - host["grads"]),
        dispatch_worst=moe.worst_extra(
            cfg.model,
            M.Shape.of(cfg.model, b, layout.seq(cfg.train.seq_len)),
            numerics(cfg.precision.name, layout),
            ac,
            cfg.train.ac_every,
            layout.ep,
        ),
    )


def deepspeed_gathered(cfg: Config, layout: Layout) -> int | None:
    """Gathered elements at the peak: DeepSpeed ZeRO-3's (gathered.of_config; moe, lora: zero.gathered; none on one
    rank: _no_gather_coalesced), FSDP's without reshard_after_forward (every block); None: FSDP's two blocks."""
    if layout.fsdp and not cfg.recipe.fsdp.reshard_after_forward and layout.pp == 1 and not moe.enabled(cfg.model):
        return cfg.model.n_layers * M.Shape.of(cfg.model, 1, 1).block_params // layout.tp
    if layout.shard != "zero3" or layout.fsdp:
        return None
    if not moe.enabled(cfg.model) and not lora.enabled(cfg.model):
        return G.of_config(cfg).peak if layout.dp * layout.cp > 1 else 0
    return Z.gathered(cfg, M.Shape.of(cfg.model, 1, 1).block_params + moe.largest_block_delta(cfg.model))


def fits(cfg: Config, hw: Hardware, row: Row) -> bool:
    """The step and the start-up both fit the GPU (less plan.reserve_gb), and start-up fits
    the node's host memory when it is known: a layout that cannot start never fits."""
    return headroom(row, hw, cfg.plan.reserve_gb) >= 0 and (
        hw.host_bytes is None or host_per_node(row, hw) <= hw.host_bytes
    )


def why_not(cfg: Config, hw: Hardware, row: Row) -> str:
    """The reason a row does not fit: the device's memory, the node's host memory, or both."""
    out = []
    if headroom(row, hw, cfg.plan.reserve_gb) < 0:
        out.append(
            f"{row.peak / GiB:.1f} GiB per {hw.unit} + {cfg.plan.reserve_gb:g} reserve over {hw.gpu_bytes / GiB:.0f}"
        )
    if hw.host_bytes is not None and host_per_node(row, hw) > hw.host_bytes:
        out.append(
            f"host memory {host_per_node(row, hw) / GiB:.1f} GiB per node over plan.host_memory_gb={hw.host_bytes / GiB:g}"
        )
    return "; ".join(out)


def headroom(row: Row, hw: Hardware, reserve_gb: float) -> int:
    """One GPU's memory (a CPU process's share) less plan.reserve_gb and the row's peak:
    negative where the row does not fit."""
    return hw.gpu_bytes - int(reserve_gb * GiB) - row.peak


def host_per_node(row: Row, hw: Hardware) -> int:
    """Host bytes the ranks of a node need: start-up's, or the offloaded states of the step."""
    return max(row.startup_host_node, sum(row.host.values()) * min(hw.gpus_per_node, hw.world))


def at_batch(cfg: Config, layout: Layout, b: int) -> Config:
    """cfg at micro-batch b: with train.global_batch set, the accumulation it derives on this
    layout's data-parallel ranks (launcher/parallel/degrees.py::grad_accum), which the memory
    (whole gradients while accumulating) and the step time depend on."""
    g = cfg.train.global_batch
    if g is None or g % (b * layout.dp):
        return cfg
    return dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, micro_batch=b, grad_accum=g // (b * layout.dp))
    )


def largest_dividing(cfg: Config, hw: Hardware, layout: Layout, ac: ACMode) -> Row:
    """train.global_batch set: the largest micro-batch that fits and divides each data-parallel
    rank's share of it, accumulation making up the rest (a micro-batch that does not divide
    it is refused by the launch); the row at 1, not fitting, when none does."""
    g, dp = cfg.train.global_batch, layout.dp
    share = g // dp if g % dp == 0 else 0
    for b in range(min(share, cfg.plan.max_micro_batch), 0, -1):
        if share % b == 0:
            row = memory_row(at_batch(cfg, layout, b), layout, ac, b, hw)
            if fits(cfg, hw, row):
                row.fits = True
                return row
    return memory_row(at_batch(cfg, layout, 1), layout, ac, 1, hw)


def largest_fitting(cfg: Config, hw: Hardware, layout: Layout, ac: ACMode) -> Row:
    """Binary search on the micro-batch: memory grows with it, monotonically."""
    if cfg.train.global_batch is not None:
        return largest_dividing(cfg, hw, layout, ac)
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


def plan(cfg: Config, hw: Hardware, available: dict[str, RecipeConfig], micro_batch: int | None = None) -> list[Row]:
    """One row per layout x activation-checkpointing mode. With `micro_batch` given the
    rows are for that micro-batch; otherwise each row has its largest fitting one. A zero
    row's reduce bucket is the default of the ranks' backend: gloo on this machine's CPU."""
    cfg = ds_config.for_backend(planned_model(cfg), ds_config.on_gloo(cfg, cuda=not hw.cpu))
    rows = []
    for layout in candidates(cfg, hw, available):
        if not runs_under(cfg, available[layout.recipe].engine, layout):
            continue
        for ac in (ACMode.none, ACMode.op, ACMode.selective, ACMode.full):
            if micro_batch is None:
                row = largest_fitting(cfg, hw, layout, ac)
            else:
                row = memory_row(at_batch(cfg, layout, micro_batch), layout, ac, micro_batch, hw)
                row.fits = fits(cfg, hw, row)
            row.step_time_s, row.tokens_per_step = step_time(
                at_batch(cfg, layout, row.micro_batch), hw, layout, ac, row.micro_batch
            )
            row.collectives = collectives.per_step(at_batch(cfg, layout, row.micro_batch), layout)
            row.gathered = G.of_layout(cfg, layout)
            row.why_not = "" if row.fits else why_not(cfg, hw, row)
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

    shape = hf.gpt_shape(cfg.model)
    params = hf.structure(cfg.model).num_params()
    if not hf.is_llama_like(cfg.model) or M.ParamCounts.of(shape).total != params:
        raise ConfigError(
            "model",
            f"hf ({shape.name})",
            f"not a Llama-layout decoder ({params:,} parameters): the "
            "planner's memory formulas (docs/memory.md) do not apply; choose the recipe and micro-batch by hand",
        )
    return dataclasses.replace(cfg, model=dataclasses.replace(shape, lora=cfg.model.lora))


def runs_under(cfg: Config, engine: str, layout: Layout) -> bool:
    """The launch would take this layout: model.lora's engines and degrees, and DeepSpeed's
    own AdamW only (launcher/optim: the other optimizers are refused under zero*)."""
    if engines.spec(engine).deepspeed and cfg.optim.name not in optim.ZERO_TAKES:
        return False
    return lora.runs_under(cfg.model, engine, layout.tp, layout.pp)


def recommended(rows: list[Row]) -> Row | None:
    return next((r for r in rows if r.recommended), None)


def no_fit_message(rows: list[Row], hw: Hardware, reserve_gb: float) -> str:
    where = f"{hw.world} CPU process(es)" if hw.cpu else f"{hw.world} GPU(s)"
    if not rows:
        return f"no layout of the planned recipes divides {where} for this model"
    smallest = min(rows, key=lambda r: r.peak)
    need = smallest.peak / GiB + reserve_gb
    what = "at start-up" if smallest.startup > smallest.total else "at micro-batch 1"
    more = (
        f"{math.ceil(need)} GiB per process: a machine with more memory, fewer processes (cluster.nproc_per_node)"
        if hw.cpu
        else f"GPUs with at least {math.ceil(need)} GiB, or more GPUs"
    )
    return (
        f"nothing fits in {hw.gpu_bytes / GiB:.0f} GiB per {hw.unit} on {where}: the smallest is "
        f"{smallest.layout.label} with activation checkpointing {smallest.ac.value} {what}, "
        f"{smallest.peak / GiB:.1f} GiB + {reserve_gb:g} GiB reserve (plan.reserve_gb); it needs {more}, "
        "or a shorter train.seq_len"
    )


# ----------------------------------------------------------------------------- output
def to_json(
    rows: list[Row], hw: Hardware, reserve_gb: float, command: str | None = None, params: dict | None = None
) -> str:
    """The rows (headroom as the table's: less plan.reserve_gb), `command`, the recommended
    `make train ...` line (None when nothing fits), and `params` (memory.param_summary)."""

    def row(r: Row) -> dict:
        d = asdict(r)
        d["layout"] = asdict(r.layout) | {"label": r.layout.label, "overrides": r.layout.overrides()}
        d["ac"] = r.ac.value
        d["total"] = r.total
        d["peak"] = r.peak
        d["headroom"] = headroom(r, hw, reserve_gb)
        return d

    return jsonout.dumps(
        {
            "gpu_bytes": hw.gpu_bytes,
            "reserve_bytes": int(reserve_gb * GiB),
            "per": hw.unit,
            "world": hw.world,
            "recommended_command": command,
            "params": params,
            "rows": [row(r) for r in rows],
        },
        indent=1,
    )


def table(rows: list[Row], hw: Hardware, title: str, reserve_gb: float):
    t = Table(title=title, show_lines=False)
    for col in (
        "",
        "layout",
        "AC",
        "micro-batch",
        "params",
        "grads",
        "optim",
        "activations",
        "temp",
        "total",
        "start-up",
        "host/node",
        "headroom",
        "cost",
    ):
        t.add_column(col, justify="left" if col in ("layout", "AC", "") else "right")
    gb = lambda v: f"{v / GiB:,.2f}"  # noqa: E731
    for r in rows:
        mark = "★" if r.recommended else ("" if r.fits else "✗")
        place = lambda k, v: gb(v) + ("*" if r.host.get(k) else "")  # noqa: E731
        t.add_row(
            mark,
            r.layout.label,
            r.ac.value,
            str(r.micro_batch) if r.fits else "-",
            place("params", r.params),
            place("grads", r.grads),
            place("optim", r.optim),
            place("activations", r.activations),
            gb(r.temp),
            gb(r.total),
            gb(r.startup),
            gb(host_per_node(r, hw)),
            gb(headroom(r, hw, reserve_gb)),
            f"{r.cost:.2f}" if r.fits else "-",
            style="bold green" if r.recommended else (None if r.fits else "dim"),
        )
    memory = "a process's share of this machine's memory" if hw.cpu else "GPU memory"
    why = "" if hw.cpu else ": the CUDA context, kernels' workspace, fragmentation"
    t.caption = (
        f"GiB per {hw.unit}. * = (partly) in host memory (offload); the host part is not counted in total. "
        "start-up = held when the engine is ready, before step 1; host/node = host memory of one node's ranks, "
        "at start-up or in the step (offloaded states and activations), the larger; "
        f"headroom = {memory} less plan.reserve_gb ({reserve_gb:g} GiB held back{why}) less the larger of "
        "total and start-up. cost = time per token relative to ★, the recommended row (the cheapest that "
        "fits). ✗ = does not fit even at micro-batch 1 (headroom below 0), or cannot start (host/node over "
        "the node's host memory)."
    )
    return t

"""`launcher plan` and the choices it makes for `recipe=auto` / `train.micro_batch=auto`:
the hardware planned for, the table, the recommended command.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import engines
from launcher import config as C
from launcher.host import HostInfo, gpu_memory_bytes, gpu_name, table_tflops
from launcher.launch.checks import asked
from launcher.launch.checks.asked import fit_precision, named
from launcher.launch.checks.validate import validate
from launcher.launch.compose import UsageError, compose_config, recipe_configs
from launcher.launch.submit import slurm
from launcher.parallel import degrees as D

if TYPE_CHECKING:
    from launcher.planner.plan import Hardware  # the planner imports torch (its meta-device counts)


def planned_host(command: str, point: list[str], here: HostInfo) -> HostInfo:
    """What recipe=auto / train.micro_batch=auto plan for: this machine, or a Slurm job's nodes."""
    auto = ("recipe=auto", "train.micro_batch=auto")
    if command != "submit" or not any(o in auto for o in point):
        return here
    return slurm.node_host(compose_config([o for o in point if o not in auto])[0], here)


def hardware(cfg: C.Config, host: HostInfo, world_from_launch: bool) -> "Hardware":
    """The GPUs to plan for: the configured cluster, or this machine's; on a machine without
    GPUs and no cluster named (cluster.gpus_per_node, cluster.gpu_memory_gb), its CPU
    processes (cluster.nproc_per_node, 2 by default), each with its share of the memory."""
    from launcher.planner import plan as planner  # local: torch (launch side)

    c = cfg.cluster
    world_from_launch = world_from_launch or on_this_cpu(cfg, host)
    if world_from_launch:
        gpn = C.nproc_per_node(cfg, host)
    else:
        gpn = c.gpus_per_node or (host.gpus if host.cuda else None)
        if gpn is None:
            raise C.ConfigError(
                "cluster.gpus_per_node",
                None,
                "needed with cluster.gpu_memory_gb on a machine "
                "without GPUs (e.g. 8); without both, the plan is for this machine's CPU",
            )
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # this machine's memory
    mem = int(c.gpu_memory_gb * 2**30) if c.gpu_memory_gb else gpu_memory_bytes()
    shared = mem is None and world_from_launch and not host.cuda
    if shared:  # ranks on this CPU: each gets its share of memory
        mem = ram // gpn
    if mem is None:
        raise C.ConfigError("cluster.gpu_memory_gb", None, "needed to plan on a machine without GPUs (e.g. 80)")
    tflops = cfg.cluster.peak_tflops or table_tflops(gpu_name()) or planner.DEFAULT_TFLOPS
    host_bytes = int(cfg.plan.host_memory_gb * 2**30) if cfg.plan.host_memory_gb else None
    if host_bytes is None and world_from_launch:  # planning for this machine: its memory
        host_bytes = ram
    return planner.Hardware(
        gpu_bytes=mem, gpus_per_node=gpn, nnodes=c.nnodes, tflops=tflops, host_bytes=host_bytes, cpu=shared
    )


def on_this_cpu(cfg: C.Config, host: HostInfo) -> bool:
    """A plan for this machine's CPU processes: it has no GPU and the config names none."""
    return not host.cuda and cfg.cluster.gpus_per_node is None and not cfg.cluster.gpu_memory_gb


def check_cpu_fit(cfg: C.Config, host: HostInfo) -> None:
    """Ranks on this machine's CPU whose plan does not fit its memory (model=gpt_1b under
    ddp on 23 GiB: killed by the kernel mid-start-up, issue 48): refused in one line, with
    what it needs. The planner imports torch (1-2 s), so a run whose model states and
    activations are far below the memory (the tiny default: a few MiB of 24 GiB) is passed
    by arithmetic alone."""
    if host.cuda:
        return
    n = C.nproc_per_node(cfg, host) * cfg.cluster.nnodes
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    m, t = cfg.model, cfg.train
    if m.kind != C.ModelKind.hf:
        rough = 16 * C.num_params(m) + t.micro_batch * t.seq_len * (40 * m.n_layers * m.dim + 12 * m.vocab_size)
        if rough * n < ram // 8:
            return
    from launcher.planner import plan as planner  # local: torch (launch side)

    hw = hardware(cfg, host, world_from_launch=True)
    try:
        shaped = planner.planned_model(cfg)
    except C.ConfigError:  # a model the planner's formulas do not cover: not refused on a guess
        return
    row = planner.memory_row(
        shaped, planner.layout_for(shaped, hw.world), t.activation_checkpointing, t.micro_batch, hw
    )
    if planner.fits(shaped, hw, row):
        return
    GiB = 2**30
    raise C.ConfigError(
        "model",
        m.name,
        f"{cfg.recipe.name} at train.micro_batch={t.micro_batch} needs about "
        f"{row.peak / GiB:.1f} GiB per process (the planner), but {n} process(es) share this machine's "
        f"{ram / GiB:.0f} GiB ({hw.gpu_bytes / GiB - cfg.plan.reserve_gb:.1f} GiB each, less "
        f"plan.reserve_gb): `make plan` with the same model shows what fits here",
    )


def available_recipes(cuda: bool = True) -> dict[str, C.RecipeConfig]:
    """The recipes the planner compares: every conf/recipe/*.yaml. On a CPU the ranks'
    memory is the host's: a recipe that offloads saves nothing there and is left out."""
    out = recipe_configs()
    if not cuda:
        out = {name: rc for name, rc in out.items() if not engines.spec(rc.engine).holds(rc).offload_optim}
    return out


def recommended_command(overrides: list[str], best) -> str:
    """`make train RECIPE=.. ARGS=".."` that trains exactly the planned row: every override
    the user gave (the model, the sequence length, the cluster planned for), less the ones
    the plan chose anew and the plan's own options, then the plan's choices."""
    chosen = best.layout.overrides()[1:] + [
        f"train.activation_checkpointing={best.ac.value}",
        f"train.micro_batch={best.micro_batch}",
    ]
    replaced = {o.split("=", 1)[0] for o in chosen} | {"recipe", "parallel.tp", "parallel.pp", "parallel.cp"}
    kept = [
        o
        for o in overrides
        if o.split("=", 1)[0].lstrip("+~") not in replaced
        and not o.lstrip("+~").startswith("plan.")
        and not o.startswith("--")
    ]
    args = " ".join(shlex.quote(o) for o in kept + chosen)
    return f'make train RECIPE={best.layout.recipe} ARGS="{args}"'


def validate_for_cluster(cfg: C.Config, world: int, host: HostInfo) -> None:
    """Validate against the cluster being planned for, not this machine: one node with all
    its `world` GPUs stands for it (the same data-parallel size, no rendezvous to check)."""
    as_one_node = dataclasses.replace(
        cfg, cluster=dataclasses.replace(cfg.cluster, nnodes=1, node_rank=0, nproc_per_node=None, gpus_per_node=world)
    )
    for note in validate(as_one_node, HostInfo(cuda=True, gpus=world, cpus=host.cpus)):
        print(f"warning: {note}", file=sys.stderr, flush=True)


def cmd_rehearse(overrides: list[str], as_json: bool = False, ranks: str | None = None) -> int:
    """`launcher rehearse`: chosen ranks of the configured layout on cluster.nnodes x
    cluster.gpus_per_node ranks, each built as a real rank builds it, on the meta device
    under a fake process group, beside the planner (launcher/planner/rehearse.py)."""
    cfg, _, _ = compose_config(overrides)
    c = cfg.cluster
    per_node = c.nproc_per_node or c.gpus_per_node
    if per_node is None:
        raise C.ConfigError(
            "cluster.gpus_per_node", None, "needed: the ranks per node of the layout to rehearse (e.g. 8)"
        )
    world = per_node * c.nnodes
    # Validated as a launch on that cluster's nodes would be (its GPUs, its node count: the
    # messages name them); the rendezvous is not rehearsed, so no port is asked for.

    on_nodes = dataclasses.replace(cfg, cluster=dataclasses.replace(c, master_port=c.master_port or 29500))
    for note in validate(on_nodes, HostInfo(cuda=True, gpus=per_node, cpus=HostInfo.detect().cpus)):
        print(f"warning: {note}", file=sys.stderr, flush=True)
    from launcher.planner import rehearse as R  # local: side (launch -> rank)
    from launcher.planner.plan import layout_of  # local: torch (launch side)

    R.rehearsable(cfg)
    chosen = None
    if ranks is not None:
        try:
            chosen = sorted({int(r) for r in ranks.split(",")})
        except ValueError:
            chosen = [-1]
        if not all(0 <= r < world for r in chosen):
            raise UsageError(
                f"--ranks {ranks}: comma-separated ranks in [0, {world - 1}] (the world is "
                f"cluster.nnodes x cluster.gpus_per_node = {c.nnodes} x {per_node})"
            )
    deg = D.degrees(cfg, world)
    layout = layout_of(cfg, deg)
    gpu_bytes = int(c.gpu_memory_gb * 2**30) if c.gpu_memory_gb else None
    if not as_json:
        print(
            f"rehearsal: model={cfg.model.name}, {layout.label} on {world} ranks ({c.nnodes} node(s) x {per_node}), "
            f"{cfg.precision.name.value}; ranks {' '.join(map(str, chosen or R.chosen_ranks(deg)))} "
            f"built one at a time under a fake process group, "
            f"{'by DeepSpeed on the host (zero.Init)' if R.partitioned(cfg) else 'on the meta device'}",
            flush=True,
        )
    show = None if as_json else (lambda r: print("\n".join(R.rank_lines(r)), flush=True))
    result = R.rehearse(cfg, world, per_node, gpu_bytes, chosen, progress=show)
    if as_json:
        print(json.dumps(result.to_dict(), indent=1))
    else:
        print("\n".join(R.summary_lines(result)))
    return 0


def cmd_plan(overrides: list[str], as_json: bool = False) -> int:
    """`launcher plan`: the table (or --json), optionally a chart; validates the config
    against the planned cluster, not this machine."""
    from launcher.planner import plan as planner  # local: torch (launch side)

    cfg, _, _ = compose_config(overrides)
    host = HostInfo.detect()
    hw = hardware(cfg, host, world_from_launch=False)
    cpu = on_this_cpu(cfg, host)
    if cpu:  # this machine's ranks, as `make train` starts them here (its default precision too)
        cfg, note = fit_precision(cfg, named(overrides), host)
        for note in [note] * bool(note) + validate(cfg, host):
            print(f"warning: {note}", file=sys.stderr, flush=True)
    else:
        validate_for_cluster(cfg, hw.world, host)
    rows = planner.plan(cfg, hw, available_recipes(not cpu))
    best, reserve = planner.recommended(rows), cfg.plan.reserve_gb
    command = recommended_command(overrides, best) if best is not None else None
    where = (
        f"this machine: {hw.gpus_per_node} CPU process(es) sharing {hw.host_bytes / 2**30:.0f} GiB (no GPU; "
        f"cluster.gpus_per_node and cluster.gpu_memory_gb plan for GPUs)"
        if cpu
        else f"{hw.nnodes} node(s) x {hw.gpus_per_node} GPU(s) of {hw.gpu_bytes / 2**30:.0f} GiB"
    )
    title = f"{cfg.model.name}: seq {cfg.train.seq_len}, {cfg.precision.name.value}, {where}"
    from launcher.planner import memory, moe  # local: torch (launch side)

    shaped = planner.planned_model(cfg).model
    if as_json:
        print(planner.to_json(rows, hw, reserve, command, memory.param_summary(shaped)))
    else:
        from rich.console import Console  # local: start-up (rich, 0.4 s)

        console = Console(width=200)
        console.print(memory.param_line(shaped), markup=False, soft_wrap=True)
        console.print(planner.table(rows, hw, title, reserve))
        if moe.enabled(shaped):
            console.print(moe.dispatch_line(shaped, cfg.train.seq_len, rows, best), markup=False, soft_wrap=True)
        console.print(
            f"recommended: {command}" if command else planner.no_fit_message(rows, hw, reserve),
            markup=False,
            soft_wrap=True,
        )  # one line, to paste
    if cfg.plan.chart:
        from launcher.planner.chart import chart  # local: torch (launch side)

        chart(rows, hw, Path(cfg.plan.chart), reserve, title)
        if not as_json:
            print(f"chart: {cfg.plan.chart}")
    return 0


def resolve_auto(overrides: list[str], host: HostInfo) -> tuple[list[str], str | None]:
    """`recipe=auto` and `train.micro_batch=auto`: ask the planner, return the overrides
    with its choice filled in, and the plan (json) to keep in the run directory."""
    auto_recipe = "recipe=auto" in overrides
    auto_mb = "train.micro_batch=auto" in overrides
    if not (auto_recipe or auto_mb):
        return overrides, None
    from launcher.planner import plan as planner  # local: torch (launch side)

    rest = [o for o in overrides if o not in ("recipe=auto", "train.micro_batch=auto")]
    cfg, _, _ = compose_config(rest)
    cfg, _ = asked.fit_precision(cfg, asked.named(rest), host)  # as the launch will run it (fp32 on a CPU without bf16)
    hw = hardware(cfg, host, world_from_launch=True)
    # The user's recipe as composed (its options overridden too), or every recipe file.
    recipes = available_recipes(host.cuda) if auto_recipe else {cfg.recipe.name: cfg.recipe}
    rows = planner.plan(cfg, hw, recipes, micro_batch=None if auto_mb else cfg.train.micro_batch)
    if not auto_recipe:  # keep the user's recipe and checkpointing; choose the micro-batch
        mine = planner.layout_for(cfg, hw.world)
        rows = [r for r in rows if r.layout == mine and r.ac == cfg.train.activation_checkpointing]
    fitting = [r for r in rows if r.fits]
    if not fitting:
        raise C.ConfigError(
            "recipe" if auto_recipe else "train.micro_batch",
            "auto",
            planner.no_fit_message(rows, hw, cfg.plan.reserve_gb),
        )
    best = min(fitting, key=lambda r: r.step_time_s / r.tokens_per_step)
    chosen = list(rest)
    if auto_recipe:
        chosen += best.layout.overrides() + [f"train.activation_checkpointing={best.ac.value}"]
    if auto_mb:  # and, should a step not fit after all, the back-off that keeps the batch
        chosen += [f"train.micro_batch={best.micro_batch}", "train.oom_backoff=true"]
    per = "per GPU" if host.cuda or cfg.cluster.gpu_memory_gb else "per rank: this machine's memory, shared"
    print(
        f"planner chose: {best.layout.label}, activation checkpointing {best.ac.value}, micro-batch "
        f"{best.micro_batch} ({best.peak / 2**30:.2f} of {hw.gpu_bytes / 2**30:.2f} GiB {per})",
        flush=True,
    )
    record = {"chosen": chosen[len(rest) :], "plan": json.loads(planner.to_json(rows, hw, cfg.plan.reserve_gb))}
    return chosen, json.dumps(record, indent=1)

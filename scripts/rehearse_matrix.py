#!/usr/bin/env python
"""The rehearsal matrix: Llama-3 8B, 70B and 405B layouts on 64, 256 and 512 ranks, and the
mixtures of experts Mixtral-8x22B on 64 and a DeepSeek-V3-like shape on 256, each
rank chosen by launcher.planner.rehearse built here (meta device, fake process group) and
set beside the planner's model states and start-up.

    python scripts/rehearse_matrix.py [--json OUT] [--only llama3_8b] [--jobs N]

Prints a markdown table (layout, rank, planned, rehearsed, difference) and the time each
layout took; tests/e2e/test_rehearse_runs.py runs it and holds every rank to the planner within
launcher.planner.rehearse.TOLERANCE; docs/memory.md shows its table.

Layouts are the ones the recipes build: fsdp, tp_fsdp (tp=8 inside a node), pp x tp
(the ranks beyond the stages are data-parallel replicas), pp_fsdp (pp x fsdp, pp x tp x
fsdp with sequence parallel) and zero3 (DeepSpeed builds it on the host: its parameter
partition against the plan); the MoEs under fsdp, at ep=1 and at ep=8 and ep=64 (FSDP cuts
Mixtral's 8 stacked experts on dimension 1, being fewer than the ranks sharding them:
launcher/parallel/experts.py::expert_placement; launcher/planner/moe.py). Each runs at sequence 8192 with full
activation checkpointing and micro-batch 1 (pp: 2 x pp micro-batches a step) on 80 GiB
devices, so the planner's verdict on the step is that of a real job's settings.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from launcher.host import usable_cores

COMMON = [
    "train.seq_len=8192",
    "train.micro_batch=1",
    "train.activation_checkpointing=full",
    "cluster.gpus_per_node=8",
    "cluster.gpu_memory_gb=80",
]


def pipeline(pp: int, recipe: str = "pp", tp: int = 1) -> list[str]:
    return [
        f"recipe={recipe}",
        f"parallel.pp={pp}",
        f"parallel.tp={tp}",
        f"parallel.pp_microbatches={2 * pp}",
        f"train.micro_batch={2 * pp}",
        *(["parallel.sequence_parallel=true"] if tp > 1 else []),
    ]


MATRIX: list[tuple[str, int, list[str]]] = [  # (model, nodes of 8, overrides)
    ("llama3_8b", 8, ["recipe=fsdp"]),
    ("llama3_8b", 8, ["recipe=tp_fsdp", "parallel.tp=8"]),
    ("llama3_8b", 8, pipeline(4, "pp_fsdp")),
    ("llama3_8b", 8, ["recipe=zero3"]),
    ("llama3_70b", 32, ["recipe=tp_fsdp", "parallel.tp=8"]),
    ("llama3_70b", 32, pipeline(8, tp=8)),
    ("llama3_70b", 32, pipeline(4, "pp_fsdp")),
    ("llama3_405b", 64, ["recipe=tp_fsdp", "parallel.tp=8"]),
    ("llama3_405b", 64, pipeline(16, "pp_fsdp", tp=8)),
    ("mixtral_8x22b", 8, ["recipe=fsdp"]),
    ("deepseek_v3", 32, ["recipe=fsdp"]),
]
EXPERT_PARALLEL: list[tuple[str, int, list[str]]] = [
    ("mixtral_8x22b", 8, ["recipe=fsdp", "parallel.ep=8"]),
    ("deepseek_v3", 32, ["recipe=fsdp", "parallel.ep=64"]),
]
"""The MoEs under the fsdp recipe's expert parallel (launcher/parallel/experts.py)."""


def layouts() -> list[tuple[str, int, list[str]]]:
    return MATRIX + EXPERT_PARALLEL


def rehearse_one(model: str, nodes: int, overrides: list[str]) -> dict:
    """One layout, in a process of its own (each rank joins a fake group of the layout's world)."""
    from launcher.host import HostInfo
    from launcher.launch.commands.plan import validate_for_cluster
    from launcher.launch.compose import compose_config
    from launcher.planner import rehearse as R

    cfg, _, _ = compose_config([f"model={model}", f"cluster.nnodes={nodes}", *COMMON, *overrides])
    world = 8 * nodes
    validate_for_cluster(cfg, world, HostInfo.detect())
    R.rehearsable(cfg)
    started = time.perf_counter()
    result = R.rehearse(cfg, world, 8, int(cfg.cluster.gpu_memory_gb * 2**30))
    row = {**result.to_dict(), "seconds": time.perf_counter() - started}
    for r in row["ranks"]:
        experts = [s["local"] for s in r.pop("shards") if s["name"].endswith("experts.w1")]
        r["experts_w1"] = experts[0] if experts else None  # the local shape of a routed-expert weight
    print(
        f"{model} {result.layout.label} on {world} ranks: {len(result.ranks)} ranks in {row['seconds']:.1f} s, "
        f"largest difference {100 * result.worst.difference:+.2f}% (rank {result.worst.rank})",
        flush=True,
    )
    return row


def share_cores(threads: int) -> None:
    """A job's torch threads: its share of the cores (jobs x all cores' threads would spin
    for the cores), unless OMP_NUM_THREADS says otherwise."""
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(threads)


def run(only: set[str] | None = None, jobs: int = 1) -> list[dict]:
    """Every layout of layouts() (of the `only` models), `jobs` at a time in processes of their
    own, each with its share of the cores; ZeRO-3's, built for real on the host and the
    slowest, start first. Rows in that order."""
    todo = [m for m in layouts() if not only or m[0] in only]
    if jobs <= 1:
        return [rehearse_one(*m) for m in todo]
    first = sorted(range(len(todo)), key=lambda i: "recipe=zero3" not in todo[i][2])
    threads = max(1, usable_cores() // jobs)
    with ProcessPoolExecutor(
        max_workers=jobs, mp_context=multiprocessing.get_context("spawn"), initializer=share_cores, initargs=(threads,)
    ) as pool:
        futures = {i: pool.submit(rehearse_one, *todo[i]) for i in first}
        return [futures[i].result() for i in range(len(todo))]


def table(rows: list[dict]) -> str:
    gib = lambda b: f"{b / 2**30:.2f}"  # noqa: E731
    lines = [
        "| model | layout | ranks | rank (pp, dp_replicate, dp_shard, tp) | model states planned / rehearsed (GiB) | difference "
        "| start-up planned / held when ready (GiB) | plan on 80 GiB |",
        "|---|---|---:|---|---:|---:|---:|---|",
    ]
    for row in rows:
        verdict = "fits" if row["fits"] else "does not fit"
        for r in row["ranks"]:
            c = r["coords"]
            if r["compared"] == "params":  # ZeRO-3: the partition; DeepSpeed takes no step on a fake group
                held = f"partition {gib(r['planned']['params'])} / {gib(r['params'])}"
                startup = f"{gib(row['planned_startup'])} / (real ranks)"
            else:
                held = f"{gib(r['planned']['model_states'])} / {gib(r['total'])}"
                startup = f"{gib(row['planned_startup'])} / {gib(r['startup'])}"
            lines.append(
                f"| {row['model']} | {row['layout']['label']} | {row['world']} | {r['rank']} "
                f"({c['pp']}, {c['dp_replicate']}, {c['dp_shard']}, {c['tp']}) "
                f"| {held} | {100 * r['difference']:+.3f}% | {startup} | {verdict} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--only", default="", help="comma-separated models")
    ap.add_argument(
        "--jobs",
        type=int,
        default=usable_cores(),
        help="layouts rehearsed at once, each in its own process (default: the cores this process may use)",
    )
    args = ap.parse_args()
    started = time.perf_counter()
    rows = run(set(args.only.split(",")) if args.only else None, args.jobs)
    print(table(rows))
    print(
        f"matrix: {sum(len(r['ranks']) for r in rows)} ranks of {len(rows)} layouts in "
        f"{time.perf_counter() - started:.0f} s"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()

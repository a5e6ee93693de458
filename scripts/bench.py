#!/usr/bin/env python
"""`make bench`: recipe throughput against a hand-written loop, measured in one run.

For each case the recipe runs through the real launcher (torchrun, the data loader, the
loop, metrics; no checkpoints, no W&B) and the baseline through torchrun as well, on the
same model, batch, precision and threads. They alternate, several rounds; the median of
each is compared. Then the parallel recipes (fsdp, tp, pp, tp_fsdp) run beside ddp on the
same model and global batch: tokens/s, peak memory and model-state bytes per rank.
Results go to bench/results.md (and bench/results.json, bench/parallel.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench"


def _run(cmd: list[str], env: dict | None = None) -> None:
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")


def run_recipe(recipe: str, model: str, steps: int, nproc: int, extra: list[str]) -> dict:
    run = OUT / "runs" / f"{recipe}-{model}"
    shutil.rmtree(run, ignore_errors=True)
    cmd = [sys.executable, "-m", "launcher", "train", f"hydra.run.dir={run}", f"recipe={recipe}", f"model={model}",
           f"train.steps={steps}", "optim.warmup_steps=5", "logger=none", "logger.log_every=10",
           "checkpoint.every=0", "checkpoint.save_final=false", f"cluster.nproc_per_node={nproc}", *extra]
    _run(cmd)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steady = rows[1:]  # the first interval holds start-up
    tokens_per_step = rows[0]["tokens_per_s"] * rows[0]["step_time_s"]
    return {"tokens_per_s": tokens_per_step / statistics.mean(r["step_time_s"] for r in steady),
            "peak_bytes": max(r["mem/peak_bytes"] for r in rows),
            "model_state_bytes": rows[-1]["mem/model_state_bytes"]}


# The parallel recipes beside ddp: (recipe, overrides). Same model, global batch, precision.
PARALLEL_CASES = [
    ("ddp", []),
    ("fsdp", []),
    ("tp", ["parallel.tp=2"]),
    ("pp", ["parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.pp_microbatches=4"]),
    ("tp_fsdp", ["parallel.tp=2"]),
]


def bench_parallel(model: str, steps: int, nproc: int, rounds: int) -> list[dict]:
    """Each recipe `rounds` times, interleaved (a slow spell of the machine hits all alike)."""
    from launcher.launch.compose import compose_config
    from launcher.models.gpt import num_params

    cfg, _, _ = compose_config([f"model={model}"])
    psi = num_params(cfg.model)
    batch = ["train.global_batch=16", "train.micro_batch=8"]
    seen: dict[str, list[dict]] = {name: [] for name, _ in PARALLEL_CASES}
    for i in range(rounds):
        for name, extra in (PARALLEL_CASES if i % 2 == 0 else PARALLEL_CASES[::-1]):
            seen[name].append(run_recipe(name, model, steps, nproc, [*batch, *extra]))
    out = []
    for name, extra in PARALLEL_CASES:
        runs = seen[name]
        r = {"recipe": name, "overrides": extra, "model": model, "nproc": nproc, "steps": steps,
             "tokens_per_s": statistics.median(x["tokens_per_s"] for x in runs),
             "peak_bytes": statistics.median(x["peak_bytes"] for x in runs),
             "model_state_bytes": runs[-1]["model_state_bytes"], "model_state_x_16psi": runs[-1]["model_state_bytes"] / (16 * psi),
             "runs": runs}
        out.append(r)
        print(f"{name:8} {model:10} {r['tokens_per_s']:10,.0f} tok/s  peak {r['peak_bytes'] / 2**20:7.0f} MiB  "
              f"model state {r['model_state_bytes'] / 2**20:7.1f} MiB/rank ({r['model_state_x_16psi']:.2f} x 16Ψ)", flush=True)
    return out


def run_baseline(script: str, model: str, steps: int, nproc: int, threads: int, args: list[str] = ()) -> dict:
    out = OUT / "runs" / f"baseline-{model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"scripts/{script}", "--model", model, "--steps", str(steps), "--out", str(out), *args]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    _run(cmd, env)
    return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--only", nargs="*", default=None, help="recipes to run against a baseline (default: all)")
    ap.add_argument("--models", nargs="*", default=None, help="models to run against a baseline (default: all)")
    ap.add_argument("--no-parallel", action="store_true", help="skip the parallel recipes beside ddp")
    args = ap.parse_args()
    threads = max(1, len(os.sched_getaffinity(0)) // args.nproc)
    cases = [("ddp", "gpt_tiny", 300, "bench_ddp_baseline.py", []),
             ("ddp", "gpt_small", 60, "bench_ddp_baseline.py", [])]
    # ZeRO against a hand-written DeepSpeed loop with the same stage and buckets.
    cases += [(f"zero{stage}", model, steps, "bench_deepspeed_baseline.py", ["--stage", str(stage)])
              for model, steps in (("gpt_tiny", 300), ("gpt_small", 60)) for stage in (1, 2, 3)]
    cases = [c for c in cases if (args.only is None or c[0] in args.only) and (args.models is None or c[1] in args.models)]
    results = []
    for recipe, model, steps, baseline, baseline_args in cases:
        ours, theirs = [], []
        for i in range(args.rounds):
            # Alternate who goes first: a slow spell of the machine hits both sides alike.
            pair = [lambda: ours.append(run_recipe(recipe, model, steps, args.nproc, [])),
                    lambda: theirs.append(run_baseline(baseline, model, steps, args.nproc, threads, baseline_args))]
            for run in (pair if i % 2 == 0 else pair[::-1]):
                run()
        ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(ours, theirs)]
        r = {"recipe": recipe, "model": model, "steps": steps,
             "recipe_tokens_per_s": statistics.median(a["tokens_per_s"] for a in ours),
             "baseline_tokens_per_s": statistics.median(b["tokens_per_s"] for b in theirs),
             "recipe_peak_bytes": max(a["peak_bytes"] for a in ours),
             "baseline_peak_bytes": max((b.get("peak_bytes", 0) for b in theirs), default=0),
             "recipe_model_state_bytes": ours[-1]["model_state_bytes"],
             "baseline_model_state_bytes": theirs[-1].get("model_state_bytes"),
             "recipe_runs": ours, "baseline_runs": theirs, "round_ratios": ratios, "ratio": statistics.median(ratios)}
        results.append(r)
        print(f"{recipe:6} {model:10} recipe {r['recipe_tokens_per_s']:10,.0f} tok/s  "
              f"hand-written {r['baseline_tokens_per_s']:10,.0f} tok/s  ratio {r['ratio']:.3f}", flush=True)

    parallel = [] if args.no_parallel else bench_parallel("gpt_small", 40, args.nproc, args.rounds)

    OUT.mkdir(exist_ok=True)
    (OUT / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (OUT / "parallel.json").write_text(json.dumps(parallel, indent=1) + "\n")
    lines = [
        "# Benchmark results",
        "",
        f"Written by `make bench` on {time.strftime('%Y-%m-%d %H:%M')}; {platform.processor() or platform.machine()}, "
        f"{len(os.sched_getaffinity(0))} cores, {args.nproc} processes x {threads} thread(s), gloo, bf16 autocast, "
        f"micro-batch 8 x 128 tokens per rank. Median of {args.rounds} rounds (recipe and hand-written back to back, order alternating); "
        f"the ratio is the median of the per-round ratios; steady-state steps only.",
        "",
        "Peak memory: the process's peak RSS on CPU (CUDA: max allocated), largest over the rounds. Model "
        "states: bytes one rank holds at the peak of a step (params, grads, optimizer states), counted "
        "from the engine's tensors the same way on both sides.",
        "",
        "| recipe | model | recipe tokens/s | hand-written tokens/s | ratio (target >= 0.97) "
        "| peak MiB recipe / hand-written | model states MiB per rank recipe / hand-written |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(f"| {r['recipe']} | {r['model']} | {r['recipe_tokens_per_s']:,.0f} | "
                     f"{r['baseline_tokens_per_s']:,.0f} | {r['ratio']:.3f} | {_mib(r['recipe_peak_bytes'])} / "
                     f"{_mib(r['baseline_peak_bytes'])} | {_mib(r['recipe_model_state_bytes'])} / "
                     f"{_mib(r['baseline_model_state_bytes'])} |")
    if parallel:
        ddp = parallel[0]
        lines += [
            "",
            "## Parallel recipes beside ddp",
            "",
            f"Same run: {ddp['model']}, {args.nproc} processes, global batch 16 x 128 tokens, bf16, "
            f"{ddp['steps']} steps; median of {args.rounds} rounds (interleaved). Peak memory is the process's "
            "peak RSS on CPU (CUDA: max allocated); model state is what rank 0 holds, counted from its tensors.",
            "",
            "| recipe | overrides | tokens/s | vs ddp | peak memory/rank | model state/rank | x 16Ψ |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for r in parallel:
            lines.append(f"| {r['recipe']} | {' '.join(r['overrides']) or '-'} | {r['tokens_per_s']:,.0f} | "
                         f"{r['tokens_per_s'] / ddp['tokens_per_s']:.2f} | {_mib(r['peak_bytes'])} MiB | "
                         f"{_mib(r['model_state_bytes'])} MiB | {r['model_state_x_16psi']:.2f} |")
    (OUT / "results.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT / 'results.md'}")
    return 0


def _mib(n) -> str:
    return f"{n / 2**20:,.1f}" if n else "n/a"


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Context parallel's price and saving: parallel.cp=1 against cp=2 on the same ranks and
global batch, through the real launcher (scripts/bench.py's runs), interleaved round after
round: tokens/s, the activation bytes rank 0 saved in its measured step
(train.measure_activations), the planner's figure for them, and the peak. -> bench/context_parallel.md

    .venv/bin/python scripts/bench_context_parallel.py --rounds 2 [--recipe fsdp --model gpt_small --seq-len 2048]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

DEGREES = (1, 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--recipe", default="fsdp")
    ap.add_argument("--model", default="gpt_small")
    ap.add_argument("--dtype", default=None, help="bf16 or fp32 (default: bf16 where native, else fp32)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=2048)
    args = ap.parse_args()
    from bench import Bench, _run, model_args, native_bf16
    from launcher.launch import cli
    from launcher.planner.footprint import activations
    from launcher.planner.plan import layout_for

    native, why = native_bf16()
    args.dtype = args.dtype or ("bf16" if native else "fp32")
    bench = Bench(args)
    model = [*model_args(args.model), f"model.max_seq_len={args.seq_len}"]
    batch = args.micro_batch * args.nproc  # the same global batch: cp=2 accumulates what dp would have split

    def overrides(cp: int) -> list[str]:
        return [
            f"recipe={args.recipe}",
            *model,
            f"precision={args.dtype}",
            f"train.seq_len={args.seq_len}",
            f"train.micro_batch={args.micro_batch}",
            f"train.global_batch={batch}",
            f"parallel.cp={cp}",
            "train.activation_checkpointing=none",
        ]

    seen: dict[int, list[dict]] = {cp: [] for cp in DEGREES}
    for i in range(args.rounds):
        for cp in DEGREES if i % 2 == 0 else DEGREES[::-1]:
            run = bench.runs / f"cp{cp}"
            shutil.rmtree(run, ignore_errors=True)
            _run(
                [
                    sys.executable,
                    "-m",
                    "launcher",
                    "train",
                    f"hydra.run.dir={run}",
                    *overrides(cp),
                    f"train.steps={args.steps}",
                    "optim.warmup_steps=1",
                    "logger=none",
                    "logger.log_every=1",
                    "checkpoint.save_final=false",
                    "train.measure_activations=true",
                    f"cluster.nproc_per_node={args.nproc}",
                ],
                bench.env,
            )
            rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            steady = rows[2:]  # step 1 holds start-up, step 2 the measurement
            seen[cp].append(
                {
                    "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in steady),
                    "activation_bytes": next(r["mem/activation_bytes"] for r in rows if "mem/activation_bytes" in r),
                    "peak_bytes": max(r["mem/peak_bytes"] for r in rows),
                }
            )
        print(
            f"round {i + 1}: " + ", ".join(f"cp={cp} {seen[cp][-1]['tokens_per_s']:,.0f} tok/s" for cp in DEGREES),
            flush=True,
        )
    planned = {}
    for cp in DEGREES:
        cfg, _, _ = cli.compose_config(overrides(cp))
        planned[cp] = activations(
            cfg, layout_for(cfg, args.nproc), cfg.train.activation_checkpointing, args.micro_batch
        )
    act = {cp: seen[cp][-1]["activation_bytes"] for cp in DEGREES}
    lines = [
        "# Context parallel: activation memory and step time",
        "",
        f"Written by scripts/bench_context_parallel.py on {time.strftime('%Y-%m-%d %H:%M')}: {args.recipe}, "
        f"`{' '.join(model)}`, {args.nproc} processes, global batch {batch} x {args.seq_len} tokens "
        f"(cp=1: micro-batch {args.micro_batch} on each rank; cp=2: each sample's {args.seq_len} positions split "
        f"over both ranks, accumulated), no recomputation, {args.dtype} ({why}); {args.rounds} rounds interleaved, "
        "median (min-max) tokens/s over steps 3 on. Activation bytes: what rank 0 saved for backward in step 2 "
        "(train.measure_activations), beside the planner's (launcher/planner/footprint.py).",
        "",
        "| parallel.cp | tokens/s | activation MiB, measured | planned | measured x cp=1 | peak MiB |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for cp in DEGREES:
        tps = [r["tokens_per_s"] for r in seen[cp]]
        lines.append(
            f"| {cp} | {statistics.median(tps):,.0f} ({min(tps):,.0f}-{max(tps):,.0f}) | "
            f"{act[cp] / 2**20:,.1f} | {planned[cp] / 2**20:,.1f} | {act[cp] / act[1]:.3f} | "
            f"{max(r['peak_bytes'] for r in seen[cp]) / 2**20:,.0f} |"
        )
    lines += [
        "",
        f"Target (issue 16): cp=2 halves the per-rank activation bytes within 15%: measured "
        f"{act[2] / act[1]:.3f}x ({'met' if abs(act[2] / act[1] - 0.5) <= 0.075 else 'missed'}). What does not "
        "halve: the rotary table, the token ids, and per block one tensor more than at cp=1 (the output "
        "projection's input, which the all-to-all back to the sequence split makes apart from attention's output).",
    ]
    out = REPO / "bench" / "context_parallel.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Activation checkpointing's price: tokens/s of none, op, selective and full through the
real launcher (scripts/bench.py's runs: torchrun, the loader, the loop), interleaved round
after round, beside the activation bytes the planner gives each (launcher/planner/memory.py,
checked against torch's MemTracker by tests/unit/test_op_recompute.py). -> bench/recompute.md

    .venv/bin/python scripts/bench_recompute.py --rounds 3 [--recipe ddp --model gpt_small --dtype fp32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

MODES = ("none", "op", "selective", "full")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--recipe", default="ddp")
    ap.add_argument("--model", default="gpt_small")
    ap.add_argument("--dtype", default=None, help="bf16 or fp32 (default: bf16 where native, else fp32)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    args = ap.parse_args()
    from bench import Bench, model_args, native_bf16
    from launcher.launch import cli
    from launcher.planner import memory as M
    from launcher.planner.footprint import numerics
    from launcher.planner.plan import layout_for

    native, why = native_bf16()
    args.dtype = args.dtype or ("bf16" if native else "fp32")
    bench = Bench(args)
    seen = {m: [] for m in MODES}
    for i in range(args.rounds):
        for mode in MODES if i % 2 == 0 else MODES[::-1]:
            seen[mode].append(bench.recipe(args.recipe, args.model, [f"train.activation_checkpointing={mode}"]))
        print(
            f"round {i + 1}: " + ", ".join(f"{m} {seen[m][-1]['tokens_per_s']:,.0f}" for m in MODES) + " tok/s",
            flush=True,
        )
    base = statistics.median(r["tokens_per_s"] for r in seen["none"])
    lines = [
        "# Activation checkpointing: memory and step time",
        "",
        f"Written by scripts/bench_recompute.py on {time.strftime('%Y-%m-%d %H:%M')}: {args.recipe}, "
        f"`{' '.join(model_args(args.model))}`, {args.nproc} processes, micro-batch {args.micro_batch} x "
        f"{args.seq_len} tokens, {args.dtype} ({why}); {args.rounds} rounds interleaved, median (min-max) "
        "tokens/s over the steady steps. Activation bytes per rank: the planner's (within 0.2% of torch's "
        "MemTracker, tests/unit/test_op_recompute.py).",
        "",
        "| mode | tokens/s | step time x none | activation MiB | x none |",
        "|---|---:|---:|---:|---:|",
    ]
    acts = {}
    for mode in MODES:
        cfg, _, _ = cli.compose_config(
            [
                f"recipe={args.recipe}",
                *model_args(args.model),
                f"precision={args.dtype}",
                f"train.seq_len={args.seq_len}",
                f"train.activation_checkpointing={mode}",
            ]
        )
        layout = layout_for(cfg, args.nproc)
        acts[mode] = M.activation_bytes(
            cfg.model,
            args.micro_batch,
            args.seq_len,
            numerics(cfg.precision.name, layout),
            cfg.train.activation_checkpointing,
            cfg.train.ac_every,
            tp=layout.tp,
        )
    for mode in MODES:
        tps = [r["tokens_per_s"] for r in seen[mode]]
        med = statistics.median(tps)
        lines.append(
            f"| {mode} | {med:,.0f} ({min(tps):,.0f}-{max(tps):,.0f}) | {base / med:.3f} | "
            f"{acts[mode] / 2**20:,.1f} | {acts[mode] / acts['none']:.2f} |"
        )
    out = REPO / "bench" / "recompute.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""One recipe against its hand-written loop on the GPUs, in interleaved rounds (make gpu-check's
part b): scripts/bench.py's two sides (the recipe through the launcher, the loop through
torchrun), back to back each round, the order alternating; tokens/s, their ratio and MFU
per round, written to --out after every round (a check stopped at its budget keeps them).

    .venv/bin/python scripts/gpu_rounds.py --model gpt_1b --recipe zero3 --rounds 3 --out rounds.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from gpu_cases import AT_SEQ, MICRO_BATCH, ROUND_TARGET, SEQ  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(AT_SEQ), required=True)
    ap.add_argument("--recipe", choices=("ddp", "fsdp", "zero1", "zero2", "zero3"), required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import torch

    import bench as bench_script
    from bench import Bench
    from launcher.device import peak_flops
    from launcher.launch import cli
    from launcher.models import flops_per_token

    bench_script.MODELS.update(AT_SEQ)  # the bench's model names: these overrides on both sides
    gpus = torch.cuda.device_count()
    bench = Bench(
        argparse.Namespace(nproc=gpus, dtype="bf16", steps=args.steps, micro_batch=MICRO_BATCH[args.model], seq_len=SEQ)
    )
    bench.runs = args.out.parent / "runs"
    bench.runs.mkdir(parents=True, exist_ok=True)
    cfg, _, _ = cli.compose_config([*AT_SEQ[args.model], f"train.seq_len={SEQ}"])
    peak, _ = peak_flops(torch.device("cuda", 0), torch.bfloat16)
    mfu = (lambda tps: tps * flops_per_token(cfg, SEQ) / (peak * gpus)) if peak else (lambda tps: None)
    ours, theirs = [], []
    for i in range(args.rounds):
        sides = [
            lambda: ours.append(bench.recipe(args.recipe, args.model)),
            lambda: theirs.append(bench.baseline(args.recipe, args.model)[0]),
        ]
        for side in sides if i % 2 == 0 else sides[::-1]:
            side()
        ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(ours, theirs)]
        out = {
            "model": args.model,
            "recipe": args.recipe,
            "seq": SEQ,
            "micro_batch": MICRO_BATCH[args.model],
            "gpus": gpus,
            "rounds": len(ratios),
            "target": ROUND_TARGET,
            "recipe_tokens_per_s": [r["tokens_per_s"] for r in ours],
            "baseline_tokens_per_s": [r["tokens_per_s"] for r in theirs],
            "ratios": ratios,
            "ratio": statistics.median(ratios),
            "mfu": mfu(statistics.median(r["tokens_per_s"] for r in ours)),
            "baseline_mfu": mfu(statistics.median(r["tokens_per_s"] for r in theirs)),
            "peak_bytes": max(r["peak_bytes"] for r in ours),
            "baseline_peak_bytes": max(r.get("peak_bytes", 0) for r in theirs),
        }
        args.out.write_text(json.dumps(out, indent=1) + "\n")
        print(
            f"round {i + 1}: {args.recipe} {args.model} {ours[-1]['tokens_per_s']:,.0f} vs "
            f"{theirs[-1]['tokens_per_s']:,.0f} tok/s ({ratios[-1]:.3f}x)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

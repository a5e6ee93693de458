#!/usr/bin/env python
"""The loss in slices: train.loss_chunks=1 against =8 through the real launcher on a
large-vocabulary model (scripts/bench.py's runs), interleaved round after round: each
rank's peak memory (on CPU the process's peak RSS; on a GPU max_memory_allocated) and
tokens/s, beside the fp32 logits bytes of one micro-batch (4 x micro x seq x vocab) that
slicing exists to avoid. -> bench/loss_chunks.md

    .venv/bin/python scripts/bench_loss_chunks.py --rounds 2 [--vocab 32768 --seq-len 1024 --micro-batch 4]
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--recipe", default="ddp")
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--dtype", default=None, help="bf16 or fp32 (default: bf16 where native, else fp32)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=1024)
    args = ap.parse_args()
    from bench import Bench, _run, native_bf16

    native, why = native_bf16()
    args.dtype = args.dtype or ("bf16" if native else "fp32")
    bench = Bench(args)
    model = ["model=gpt_small", f"model.vocab_size={args.vocab}", f"model.max_seq_len={args.seq_len}"]
    cases = (1, args.chunks)
    seen: dict[int, list[dict]] = {n: [] for n in cases}
    for i in range(args.rounds):
        for n in cases if i % 2 == 0 else cases[::-1]:
            run = bench.runs / f"loss_chunks{n}"
            shutil.rmtree(run, ignore_errors=True)
            _run(
                [
                    sys.executable,
                    "-m",
                    "launcher",
                    "train",
                    f"hydra.run.dir={run}",
                    f"recipe={args.recipe}",
                    *model,
                    f"precision={args.dtype}",
                    f"train.seq_len={args.seq_len}",
                    f"train.micro_batch={args.micro_batch}",
                    f"train.loss_chunks={n}",
                    f"train.steps={args.steps}",
                    "optim.warmup_steps=1",
                    "logger=none",
                    "logger.log_every=1",
                    "checkpoint.save_final=false",
                    f"cluster.nproc_per_node={args.nproc}",
                ],
                bench.env,
            )
            rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            seen[n].append(
                {
                    "peak_bytes": max(r["mem/peak_bytes"] for r in rows),
                    "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in rows[1:]),
                }
            )
        print(
            f"round {i + 1}: "
            + ", ".join(f"loss_chunks={n} peak {seen[n][-1]['peak_bytes'] / 2**20:,.0f} MiB" for n in cases),
            flush=True,
        )
    logits = 4 * args.micro_batch * args.seq_len * args.vocab
    peak = {n: statistics.median(r["peak_bytes"] for r in seen[n]) for n in cases}
    cut = peak[1] - peak[args.chunks]
    lines = [
        "# The loss in slices: peak memory and step time",
        "",
        f"Written by scripts/bench_loss_chunks.py on {time.strftime('%Y-%m-%d %H:%M')}: {args.recipe}, "
        f"`{' '.join(model)}`, {args.nproc} processes, micro-batch {args.micro_batch} x {args.seq_len} tokens, "
        f"{args.dtype} ({why}); {args.rounds} rounds interleaved, median (min-max). Peak: rank 0's "
        "mem/peak_bytes over the run (the process's peak RSS on CPU: the interpreter, torch and the model "
        "states included, the same in both rows).",
        "",
        "| train.loss_chunks | peak MiB | tokens/s |",
        "|---:|---:|---:|",
    ]
    for n in cases:
        p = [r["peak_bytes"] / 2**20 for r in seen[n]]
        t = [r["tokens_per_s"] for r in seen[n]]
        lines.append(
            f"| {n} | {statistics.median(p):,.0f} ({min(p):,.0f}-{max(p):,.0f}) | "
            f"{statistics.median(t):,.0f} ({min(t):,.0f}-{max(t):,.0f}) |"
        )
    lines += [
        "",
        f"fp32 logits of one micro-batch: {logits / 2**20:,.0f} MiB. loss_chunks={args.chunks} lowered the peak "
        f"by {cut / 2**20:,.0f} MiB = {cut / logits:.2f}x of them (target, issue 16: at least 0.7x; "
        f"{'met' if cut >= 0.7 * logits else 'missed'}).",
    ]
    out = REPO / "bench" / "loss_chunks.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

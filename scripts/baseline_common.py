"""What the hand-written baselines share: the timed loop and the result file (the loops
themselves stay in each script, written out as a user would)."""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist

from launcher.device import memory_stats


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt_tiny")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--warmup", type=int, default=10, help="steps not timed")
    ap.add_argument("--out", required=True)
    return ap


def timed_loop(args, optimizer, step_fn) -> float:
    """`args.steps` steps of `step_fn(batch)` on random tokens made up front, cosine lr set by
    hand; returns the seconds of the steps after `args.warmup`."""
    batches = torch.randint(0, 256, (16, args.micro_batch, args.seq_len + 1))
    for step in range(args.steps):
        if step == args.warmup:
            dist.barrier()
            t0 = time.perf_counter()
        lr = 3e-3 * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for g in optimizer.param_groups:
            g["lr"] = lr
        step_fn(batches[step % 16])
    dist.barrier()
    return time.perf_counter() - t0


def report(args, elapsed: float, model_state_bytes: int) -> None:
    """Rank 0 writes tokens/s, step time, peak memory and model-state bytes to args.out."""
    timed = args.steps - args.warmup
    tokens = timed * args.micro_batch * args.seq_len * dist.get_world_size()
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"tokens_per_s": tokens / elapsed, "step_time_s": elapsed / timed,
                       "peak_bytes": memory_stats(torch.device("cpu"))["mem/peak_bytes"],
                       "model_state_bytes": model_state_bytes,
                       "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS")}, f)

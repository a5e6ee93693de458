#!/usr/bin/env python
"""The yardstick for the ddp recipe: a minimal hand-written DDP loop (nanoGPT style) on
the same model, batch, precision and threads. No data loader (random tokens made up
front), no logging, no checkpoints: the fastest honest loop.

    torchrun --nproc-per-node 2 scripts/bench_ddp_baseline.py --model gpt_tiny --steps 150 --out b.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from launcher.cli import compose_config
from launcher.device import memory_stats
from launcher.engine import optimizer_state_bytes, tensor_bytes
from launcher.models.gpt import GPT


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt_tiny")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--warmup", type=int, default=10, help="steps not timed")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, _, _ = compose_config([f"model={args.model}"])
    torch.manual_seed(0)
    model = GPT(cfg.model)
    ddp = DDP(model, gradient_as_bucket_view=True, forward_sync_buffers=False)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.95))
    batches = torch.randint(0, 256, (16, args.micro_batch, args.seq_len + 1))

    for step in range(args.steps):
        if step == args.warmup:
            dist.barrier()
            t0 = time.perf_counter()
        lr = 3e-3 * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        b = batches[step % 16]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ddp(b[:, :-1], b[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
    dist.barrier()
    elapsed = time.perf_counter() - t0
    timed = args.steps - args.warmup
    tokens = timed * args.micro_batch * args.seq_len * world
    params = list(model.parameters())
    held = tensor_bytes(params) + tensor_bytes(p.grad for p in params) + optimizer_state_bytes(opt)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"tokens_per_s": tokens / elapsed, "step_time_s": elapsed / timed,
                       "peak_bytes": memory_stats(torch.device("cpu"))["mem/peak_bytes"], "model_state_bytes": held,
                       "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS")}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

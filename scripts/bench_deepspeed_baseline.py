#!/usr/bin/env python
"""The yardstick for the zero recipes: a minimal hand-written DeepSpeed loop on the same
model, batch, precision and threads, with the ZeRO settings the recipe files resolve to
(stage, overlap_comm, buckets of dim^2 elements). No data loader (random tokens made up
front), no logging, no checkpoints: the fastest honest DeepSpeed loop.

    torchrun --nproc-per-node 2 scripts/bench_deepspeed_baseline.py --stage 2 --model gpt_tiny --steps 150 --out b.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist

from launcher.cli import compose_config
from launcher.device import deepspeed_env, memory_stats
from launcher.models.gpt import GPT


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, required=True)
    ap.add_argument("--model", default="gpt_tiny")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--warmup", type=int, default=10, help="steps not timed")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    deepspeed_env()
    import deepspeed

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, _, _ = compose_config([f"model={args.model}"])
    torch.manual_seed(0)
    model = GPT(cfg.model)
    dim2 = cfg.model.dim ** 2
    zero = {"stage": args.stage, "overlap_comm": args.stage >= 2, "contiguous_gradients": True,
            "reduce_bucket_size": dim2, "allgather_bucket_size": dim2}
    if args.stage == 3:
        zero.update({"stage3_prefetch_bucket_size": int(0.9 * dim2),
                     "stage3_param_persistence_threshold": 10 * cfg.model.dim})
    config = {
        "train_batch_size": args.micro_batch * world, "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "steps_per_print": 2**31 - 1,
        "bf16": {"enabled": True}, "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1,
                                                  "torch_adam": True}},
    }
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    batches = torch.randint(0, 256, (16, args.micro_batch, args.seq_len + 1))

    for step in range(args.steps):
        if step == args.warmup:
            dist.barrier()
            t0 = time.perf_counter()
        lr = 3e-3 * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for g in optimizer.param_groups:
            g["lr"] = lr
        b = batches[step % 16]
        loss = engine(b[:, :-1], b[:, 1:])
        engine.backward(loss)
        engine.step()
    dist.barrier()
    elapsed = time.perf_counter() - t0
    timed = args.steps - args.warmup
    tokens = timed * args.micro_batch * args.seq_len * world
    # One more (untimed) step, its model-state bytes counted the way the recipe counts them.
    from recipes.zero import ZeroMemory

    memory = ZeroMemory(optimizer, engine.module, torch.device("cpu"))
    memory.start_step()
    b = batches[0]
    engine.backward(engine(b[:, :-1], b[:, 1:]))
    memory.sample()
    engine.step()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"tokens_per_s": tokens / elapsed, "step_time_s": elapsed / timed,
                       "peak_bytes": memory_stats(torch.device("cpu"))["mem/peak_bytes"],
                       "model_state_bytes": memory.breakdown().total,
                       "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS")}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

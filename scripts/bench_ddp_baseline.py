#!/usr/bin/env python
"""The yardstick for the ddp recipe: a minimal hand-written DDP loop (nanoGPT style) on
the same model, batch, precision and threads. No data loader (random tokens made up
front), no logging, no checkpoints: the fastest honest loop.

    torchrun --nproc-per-node 2 scripts/bench_ddp_baseline.py --model model=gpt_tiny --steps 30 --out b.json
"""

from __future__ import annotations

import torch
from baseline_common import adamw, compute, finish, report, start, timed_loop
from torch.nn.parallel import DistributedDataParallel as DDP

from engines.ddp.engine import (
    no_buffer_sync,
)  # forward_sync_buffers=False, or broadcast_buffers=False before torch 2.13
from launcher.rank.engine import optimizer_state_bytes, tensor_bytes


def main() -> None:
    args, mcfg, model = start()
    ddp = DDP(model, gradient_as_bucket_view=True, **no_buffer_sync())
    opt = adamw(model)

    def step(b):
        with compute(args):
            loss = ddp(b[:, :-1], b[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)

    elapsed = timed_loop(args, opt, step, mcfg.vocab_size)
    params = list(model.parameters())
    report(args, elapsed, tensor_bytes(params) + tensor_bytes(p.grad for p in params) + optimizer_state_bytes(opt))
    finish()


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""The yardstick for the ddp recipe: a minimal hand-written DDP loop (nanoGPT style) on
the same model, batch, precision and threads. No data loader (random tokens made up
front), no logging, no checkpoints: the fastest honest loop.

    torchrun --nproc-per-node 2 scripts/bench_ddp_baseline.py --model gpt_tiny --steps 150 --out b.json
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from baseline_common import parser, report, timed_loop
from launcher.launch.compose import compose_config
from launcher.rank.engine import optimizer_state_bytes, tensor_bytes
from launcher.models.gpt import GPT


def main() -> None:
    ap = parser()
    args = ap.parse_args()

    dist.init_process_group("gloo")
    cfg, _, _ = compose_config([f"model={args.model}"])
    torch.manual_seed(0)
    model = GPT(cfg.model)
    ddp = DDP(model, gradient_as_bucket_view=True, forward_sync_buffers=False)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.95))

    def step(b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ddp(b[:, :-1], b[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)

    elapsed = timed_loop(args, opt, step)
    params = list(model.parameters())
    report(args, elapsed, tensor_bytes(params) + tensor_bytes(p.grad for p in params) + optimizer_state_bytes(opt))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

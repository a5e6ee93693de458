#!/usr/bin/env python
"""The yardstick for the fsdp recipe: a minimal hand-written FSDP2 loop (torchtitan
style: `fully_shard` on every block, then the root) on the same model, batch, precision
and threads. Under bf16 the parameters are gathered in bf16 and gradients reduced in
fp32, as the recipe does. No data loader, no logging, no checkpoints.

    torchrun --nproc-per-node 2 scripts/bench_fsdp_baseline.py --model model=gpt_tiny --steps 30 --out b.json
"""

from __future__ import annotations

import torch
from baseline_common import adamw, batch, finish, report, start, timed_loop
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from launcher.rank.engine import local_shard, optimizer_state_bytes


def main() -> None:
    args, mcfg, model = start()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if args.dtype == "bf16" else None, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = adamw(model)

    def step(b):
        loss = model(b[:, :-1], b[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    elapsed = timed_loop(args, opt, step, mcfg.vocab_size)
    # One more (untimed) backward, its gradient shards counted as the recipe counts them.
    b = batch(args, mcfg.vocab_size)
    model(b[:, :-1], b[:, 1:]).backward()
    grad_bytes = sum(local_shard(p.grad).nbytes for p in model.parameters() if p.grad is not None)
    params = sum(local_shard(p.detach()).nbytes for p in model.parameters())
    report(args, elapsed, params + grad_bytes + optimizer_state_bytes(opt))
    finish()


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""The yardstick for the zero recipes: a minimal hand-written DeepSpeed loop on the same
model, batch, precision and threads. No data loader (random tokens made up front), no
logging, no checkpoints: the fastest honest DeepSpeed loop. Its ZeRO settings (--zero):

- recipe: those conf/recipe/zero<stage>.yaml resolves to, through the functions that write
  the recipe's ds_config.json (launcher/parallel/ds_config.py::for_backend, zero_section: the
  reduce bucket of the backend, dim^2 on NCCL, the whole model up to 5e7 on gloo; stage 3's
  prefetch of one block's matmul weights, persistence below 10 x dim).
  The same settings: the ratio measures the wrapper.
- deepspeed: the stage alone, every other key DeepSpeed's own default (buckets of 5e8
  elements, overlap_comm only at stage 3, prefetch 5e7, persistence 1e5): the loop a user
  writes from DeepSpeed's tutorial. The ratio measures the recipe's settings too.

    torchrun --nproc-per-node 2 scripts/bench_deepspeed_baseline.py --stage 2 --model model=gpt_tiny --steps 30 --out b.json
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from baseline_common import batch, finish, model_config, param_groups, parser, report, start_process_group, timed_loop

from launcher.config import Config, RecipeConfig, ZeroOptions
from launcher.host import deepspeed_env
from launcher.models.gpt import GPT
from launcher.parallel.ds_config import for_backend, zero_section

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = parser()
    ap.add_argument("--stage", type=int, required=True)
    ap.add_argument("--zero", choices=("recipe", "deepspeed"), default="recipe", help="whose ZeRO settings")
    args = ap.parse_args()

    deepspeed_env()
    import deepspeed

    device = start_process_group(args)
    world = dist.get_world_size()
    mcfg = model_config(args)
    torch.manual_seed(0)
    model = GPT(mcfg).to(device)
    zero = {"stage": args.stage}
    if args.zero == "recipe":
        recipe = yaml.safe_load((REPO / "conf" / "recipe" / f"zero{args.stage}.yaml").read_text())
        cfg = Config(model=mcfg, recipe=RecipeConfig(engine="zero", zero=ZeroOptions(**recipe["zero"])))
        zero = zero_section(for_backend(cfg, device.type != "cuda"), mcfg.dim**2)
    config = {
        "train_batch_size": args.micro_batch * world,
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 2**31 - 1,
        "bf16": {"enabled": args.dtype == "bf16"},
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1, "torch_adam": True},
        },
    }
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=config)

    def step(b):
        loss = engine(b[:, :-1], b[:, 1:])
        engine.backward(loss)
        engine.step()

    elapsed = timed_loop(args, optimizer, step, mcfg.vocab_size)
    # One more (untimed) step, its model-state bytes counted the way the recipe counts them.
    from engines.zero.engine import ZeroMemory

    memory = ZeroMemory(optimizer, engine.module, device)
    memory.start_step()
    b = batch(args, mcfg.vocab_size)
    engine.backward(engine(b[:, :-1], b[:, 1:]))
    memory.sample()
    engine.step()
    report(args, elapsed, memory.breakdown().total)
    finish()


if __name__ == "__main__":
    main()

"""What the hand-written baselines share: the arguments, the timed loop and the result file
(the loops themselves stay in each script, written out as a user would).

A baseline does what a user's own script does and nothing else: random tokens made up
front, no data loader, no logging, no checkpoints, no watchdog; the learning rate set by
hand each step. Timing starts after `--warmup` untimed steps and ends after `--steps`,
each end behind a barrier. On a machine with GPUs each rank takes its own (LOCAL_RANK)
and NCCL, as the project's ranks do, so the same scripts give the GPU's yardstick.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time

import torch
import torch.distributed as dist

from launcher.device import backend_for, local_device, memory_stats, synchronize
from launcher.exits import exit_now


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--model",
        nargs="+",
        default=["model=gpt_tiny"],
        help="the model's config overrides, as make train takes them (model=gpt_small model.dim=256 ...)",
    )
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="fp32")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10, help="steps not timed")
    ap.add_argument("--compile", action="store_true", help="torch.compile each block (as train.compile=true does)")
    ap.add_argument("--out", required=True)
    return ap


def model_config(args):
    """The model's config from the same overrides the recipe's run gets (model=NAME reads
    conf/model/NAME.yaml, model.KEY=VALUE sets a field), read as a user's script would:
    with PyYAML, not Hydra."""
    import dataclasses
    from pathlib import Path

    import yaml

    from launcher.config.model import ModelConfig

    fields: dict = {}
    for override in args.model:
        key, _, value = override.partition("=")
        if key == "model":
            path = Path(__file__).resolve().parent.parent / "conf" / "model" / f"{value}.yaml"
            fields.update(yaml.safe_load(path.read_text()))
        elif key.startswith("model."):
            fields[key.removeprefix("model.")] = yaml.safe_load(value)
        else:
            raise SystemExit(f"--model {override}: expected model=NAME or model.KEY=VALUE")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in fields.items() if k in known})


def start_process_group(args) -> torch.device:
    """This rank's device (its GPU, else the CPU), kept as args.device, and the process
    group on it (NCCL, else gloo)."""
    args.device = local_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend_for(args.device))
    return args.device


def start():
    """What every hand-written loop starts with: its arguments, the process group, the
    model's config and the model on this rank's device, drawn from seed 0. Returns (args,
    model config, model)."""
    from launcher.models.gpt import GPT

    args = parser().parse_args()
    device = start_process_group(args)
    mcfg = model_config(args)
    torch.manual_seed(0)
    model = GPT(mcfg).to(device)
    if args.compile:
        for block in model.layers:
            block.compile()
    return args, mcfg, model


def param_groups(model) -> list[dict]:
    """Weight decay on the matrices only, as the recipes group them."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]


def adamw(model) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(model), lr=3e-3, betas=(0.9, 0.95))


def compute(args):
    """The autocast context of --dtype (none in fp32)."""
    if args.dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(args.device.type, dtype=torch.bfloat16)


def batch(args, vocab_size: int) -> torch.Tensor:
    """One more random batch on the rank's device (the untimed step that counts memory)."""
    return torch.randint(0, vocab_size, (args.micro_batch, args.seq_len + 1)).to(args.device)


def timed_loop(args, optimizer, step_fn, vocab_size: int) -> float:
    """`args.steps` steps of `step_fn(batch)` on random tokens made up front, cosine lr set by
    hand; returns the seconds of the steps after `args.warmup`."""
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    g = torch.Generator().manual_seed(dist.get_rank())
    batches = torch.randint(0, vocab_size, (16, args.micro_batch, args.seq_len + 1), generator=g).to(args.device)
    for step in range(args.steps):
        if step == args.warmup:
            synchronize(args.device)
            dist.barrier()
            t0 = time.perf_counter()
        lr = 3e-3 * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        step_fn(batches[step % 16])
    synchronize(args.device)
    dist.barrier()
    return time.perf_counter() - t0


def finish() -> None:
    """Leave as the project's ranks do (launcher.exits.exit_now: no interpreter teardown)."""
    dist.destroy_process_group()
    exit_now(0)


def report(args, elapsed: float, model_state_bytes: int) -> None:
    """Rank 0 writes tokens/s, step time, peak memory and model-state bytes to args.out."""
    timed = args.steps - args.warmup
    tokens = timed * args.micro_batch * args.seq_len * dist.get_world_size()
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "tokens_per_s": tokens / elapsed,
                    "step_time_s": elapsed / timed,
                    "peak_bytes": memory_stats(args.device)["mem/peak_bytes"],
                    "model_state_bytes": model_state_bytes,
                    "threads": torch.get_num_threads(),
                    "omp": os.environ.get("OMP_NUM_THREADS"),
                },
                f,
            )

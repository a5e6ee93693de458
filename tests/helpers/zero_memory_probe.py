"""Model-state bytes per rank of the ZeRO recipes, measured by their own engines (and the
loss of each step, to compare with ddp's on the same batches).

    python -m torch.distributed.run --standalone --nproc-per-node N tests/helpers/zero_memory_probe.py OUT.json RECIPE:MODEL... [--held HELD.json RECIPE...]

For each recipe and model (composed from conf/ as a user would: precision bf16, two
micro-batches per step), the launch side's ds_config.json is written, the real engine is
built (engines.build), two optimizer steps are taken (Adam creates its moments during the
first), and rank 0 writes every rank's `state_bytes()` of the second step to OUT.json, with
the losses and how far `consolidated_state_dict()` is from the first case's (ddp's) weights. Building the engines one after another in one job keeps the
test to one launch per world size. --held: then, in the same process group,
zero_backward_probe.py's measurement of each RECIPE to HELD.json (one launch for both tests).
"""

from __future__ import annotations

import gc
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import zero_backward_probe

import engines
from launcher.exits import exit_now
from launcher.host import deepspeed_env
from launcher.launch import cli
from launcher.models.gpt import GPT
from launcher.parallel import ds_config
from launcher.rank.engine import BuildContext


def measure(recipe: str, model: str, rank: int, world: int, scratch: Path) -> dict:
    cfg, _, _ = cli.compose_config(
        [
            f"recipe={recipe}",
            f"model={model}",
            "precision=bf16",
            "train.micro_batch=1",
            "train.seq_len=16",
            "train.grad_accum=2",
        ]
    )
    run_dir = scratch / f"{recipe}-{model}"
    if rank == 0:
        run_dir.mkdir()
        if cfg.recipe.engine == "zero":
            (run_dir / ds_config.FILE).write_text(ds_config.text(ds_config.launch_config(cfg, world, cuda=False)))
    dist.barrier()
    torch.manual_seed(cfg.train.seed)
    net = GPT(cfg.model)
    psi = net.num_params()
    largest = max(p.numel() for p in net.parameters())
    engine = engines.build(
        BuildContext(
            cfg=cfg,
            model=net,
            device=torch.device("cpu"),
            rank=rank,
            world_size=world,
            local_rank=rank,
            grad_accum=2,
            run_dir=run_dir,
        )
    )
    gen = torch.Generator().manual_seed(rank)  # each rank its own batches, the same for every recipe
    losses = []
    for _ in range(2):
        tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.train.seq_len + 1), generator=gen)
        result = engine.train_step([(tokens[i : i + 1, :-1], tokens[i : i + 1, 1:]) for i in range(2)])
        loss = result.loss.detach().clone()
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
    weights = engine.consolidated_state_dict()  # a collective under stage 3
    b = engine.state_bytes()
    mine = {"params": b.params, "grads": b.grads, "optim": b.optim, "total": b.total, "host": b.host, "where": b.where}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    del engine, net
    gc.collect()
    result = {
        "recipe": recipe,
        "model": model,
        "world_size": world,
        "psi": psi,
        "largest_param": largest,
        "ranks": everyone,
        "losses": losses,
    }
    return result, weights


def main() -> None:
    args = sys.argv[1:]
    held = args[args.index("--held") + 1 :] if "--held" in args else []
    out, cases = Path(args[0]), [c.split(":") for c in args[1 : len(args) - len(held) - bool(held)]]
    deepspeed_env()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    scratch = [tempfile.mkdtemp(prefix="zero-memory-") if rank == 0 else None]
    dist.broadcast_object_list(scratch)
    results, reference = [], {}
    for recipe, model in cases:  # ddp first for each model: its weights are the reference
        result, weights = measure(recipe, model, rank, world, Path(scratch[0]))
        reference.setdefault(model, weights)
        ref = reference[model]
        result["weight_names_match"] = sorted(weights) == sorted(ref) and all(
            weights[k].shape == ref[k].shape for k in ref
        )
        result["max_weight_diff"] = (
            max((weights[k] - ref[k]).abs().max().item() for k in ref) if result["weight_names_match"] else None
        )
        results.append(result)
    if rank == 0:
        out.write_text(json.dumps(results, indent=1))
    if held:
        zero_backward_probe.report(Path(held[0]), held[1:], rank, world, Path(scratch[0]))
    if rank == 0:
        shutil.rmtree(scratch[0], ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now(0)  # as a rank: no interpreter teardown, which can abort a finished gloo process

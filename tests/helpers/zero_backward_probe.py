"""What a ZeRO rank does in one step's backward and reduction, on the recipe's own config
(one micro-batch a step, bf16, gpt_tiny): the gradient elements it holds in `param.grad` when
backward has ended, just before DeepSpeed reduces them, and the collectives DeepSpeed
launches in the step, counted where its communication backend (deepspeed.comm's cdb) hands
them to torch (kind and elements; scalars such as the gradient norm left out).

    python -m torch.distributed.run --standalone --nproc-per-node N tests/helpers/zero_backward_probe.py OUT.json RECIPE[:OVERRIDE,...]...

zero1 (without overlap_comm, its default) leaves the reduction until backward has ended
(stage_1_and_2.py::reduce_gradients), so its whole gradients exist then; zero2 reduces
them through its buckets as backward makes them. launcher/planner/footprint.py::grads_at_peak
counts the first, launcher/planner/collectives.py::per_step the collectives; a null reduce
bucket is resolved for gloo, as the launch side does. tests/e2e/test_zero.py reads OUT.json
(written in the launch of zero_memory_probe.py --held, which calls `report`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import probes
import torch
import torch.distributed as dist

from launcher import models
from launcher.exits import exit_now
from launcher.launch.compose import compose_config
from launcher.parallel import ds_config
from launcher.rank.entry import build_engine

KINDS = {
    "all_reduce": "all_reduce",
    "reduce": "reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
}
SCALAR = 64  # elements: a norm, an overflow flag, a loss


def case_config(case: str, world: int):
    """RECIPE[:OVERRIDE,...] composed as the probe runs it, its reduce bucket as gloo's."""
    recipe, _, more = case.partition(":")
    cfg, _, _ = compose_config(
        [
            f"recipe={recipe}",
            "model=gpt_tiny",
            "precision=bf16",
            "train.micro_batch=2",
            "train.seq_len=32",
            "train.grad_accum=1",
            f"cluster.nproc_per_node={world}",
            *(o for o in more.split(",") if o),
        ]
    )
    return ds_config.for_backend(cfg, gloo=True)


def elements(args, kwargs) -> int:
    """A collective's elements: its first tensor argument (the output where it comes first:
    all_gather_into_tensor, reduce_scatter_tensor), or a list's total."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.numel()
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            return sum(t.numel() for t in value)
    return 0


def count_collectives(seen: list) -> None:
    """Record [kind, elements] of every collective deepspeed.comm launches from now on."""
    from deepspeed.comm import comm  # local: after DeepSpeed made its backend

    for name, kind in KINDS.items():
        original = getattr(comm.cdb, name, None)

        def counting(*args, _original=original, _kind=kind, **kwargs):
            n = elements(args, kwargs)
            if n > SCALAR:
                seen.append([_kind, n])
            return _original(*args, **kwargs)

        if original is not None:
            setattr(comm.cdb, name, counting)


def probe(case: str, rank: int, world: int, scratch: Path) -> dict:
    cfg = case_config(case, world)
    run_dir = probes.run_dir(cfg, scratch / case.replace(":", "_").replace("=", "-"), rank, world)
    engine = build_engine(
        cfg, models.prepare(models.on_meta(cfg), cfg), torch.device("cpu"), rank, world, rank, run_dir
    )
    opt, held, launched = engine.engine.optimizer, [], []
    for name in ("reduce_gradients", "overlapping_partition_gradients_reduce_epilogue"):  # stage 1, stage 2
        if not hasattr(opt, name):
            continue

        def counting(*args, _original=getattr(opt, name), **kwargs):
            held.append(sum(p.grad.numel() for p in engine.model.parameters() if p.grad is not None))
            return _original(*args, **kwargs)

        setattr(opt, name, counting)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 33), generator=torch.Generator().manual_seed(rank))
    engine.train_step([(tokens[:, :-1], tokens[:, 1:])])  # the first step: DeepSpeed's own set-up
    count_collectives(launched)
    engine.train_step([(tokens[:, :-1], tokens[:, 1:])])
    from deepspeed.comm import comm

    for name in KINDS:
        vars(comm.cdb).pop(name, None)
    return {"held": held[-1] if held else None, "collectives": launched}


def report(out: Path, cases: list[str], rank: int, world: int, scratch: Path) -> None:
    """Each case's held gradient elements and collectives on every rank, to `out` (rank 0)."""
    seen = {case: probe(case, rank, world, scratch) for case in cases}
    everyone = [None] * world
    dist.all_gather_object(everyone, seen)
    if rank == 0:
        out.write_text(json.dumps({"world_size": world, "ranks": everyone}))


def main() -> None:
    rank, world, scratch = probes.join("zero-backward-")
    report(Path(sys.argv[1]), sys.argv[2:], rank, world, scratch)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now(0)  # as a rank: no interpreter teardown, which can abort a finished gloo process

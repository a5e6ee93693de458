"""Per-rank entry: `python -m launcher.rank RUN_DIR` (or RUN_DIR/config.yaml; launcher/rank/__main__.py).

Reads the frozen config the launch side wrote (ranks never compose Hydra configs),
initialises torch.distributed, builds the model, data and the recipe's engine, and runs
the loop. Works under the launcher's torchrun, under a torchrun typed by hand, and as a
single process with no launcher at all.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import socket
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

import engines
from launcher import config as C
from launcher import models, offline, provenance, runlock
from launcher.data.read import build_dataset
from launcher.device import autocast_dtype, backend_for, local_device, returned_to_the_os, startup_peaks, use_tf32
from launcher.exits import COMM_TRACE
from launcher.host import current_rss, process_start_time
from launcher.manifest import describe, lock_folders, manifest_step, root_of
from launcher.models import init
from launcher.parallel import degrees as D
from launcher.rank.checkpoint import Checkpointer
from launcher.rank.engine import BuildContext, Engine
from launcher.rank.loop import Job, run
from launcher.rank.preempt import Preemption
from launcher.rank.store import job_store


def _single_process_env() -> None:
    """Without torchrun: a world of one, on a free local port."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_engine(
    cfg: C.Config,
    model: torch.nn.Module,
    device: torch.device,
    rank: int,
    world_size: int,
    local_rank: int,
    run_dir: Path,
) -> Engine:
    """The model's structure on the meta device (no storage; models.on_meta, prepared),
    handed to the recipe's engine: the recipe parallelizes it, then materializes only this
    rank's part (launcher/models/init.py: the same initial weights at every layout, no
    broadcast)."""
    engine = engines.build(
        BuildContext(
            cfg=cfg,
            model=model,
            device=device,
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            grad_accum=D.grad_accum(cfg, world_size),
            run_dir=run_dir,
        )
    )
    if not isinstance(engine, Engine):  # the loop relies on the contract's hooks and defaults
        raise TypeError(
            f"recipe.engine={cfg.recipe.engine}: its build() returned a {type(engine).__name__}, "
            "not a launcher.rank.engine.Engine"
        )
    return engine


def start(
    cfg: C.Config, device: torch.device, rank: int, world_size: int, local_rank: int, run_dir: Path, started: float
):
    """From a process group to a ready engine: (engine, this rank's start-up figures,
    launcher.device.startup_peaks). scripts/bench_startup.py measures start-up through here."""
    spec = engines.spec(cfg.recipe.engine)
    engines.engine(cfg.recipe.engine)  # its imports (DCP, FSDP, pipelining) belong to the baseline, not to the model
    if spec.preload:  # the engine's libraries (DeepSpeed) too
        spec.preload()
    seed_everything(cfg.train.seed)
    model = models.prepare(models.on_meta(cfg), cfg)  # its imports too (transformers); no storage
    if spec.builds_on_meta:
        # Sharding on meta runs some ops through torch's Python meta kernels, which load once
        # per process (about 35 MB, a second): torch's start-up, not this model's memory.
        torch.ones(1, device="meta").pow(2)
    base = current_rss()
    with returned_to_the_os():
        engine = build_engine(cfg, model, device, rank, world_size, local_rank, run_dir)
        startup = startup_peaks(device, started, base, built=init.BUILT_PEAK_RSS)  # engine ready, before step 1
    # what trains (model.lora: the adapters) of the whole model, counted on its meta structure
    startup["params"] = init.full_numel(model)
    startup["trainable_params"] = init.full_numel(model, trainable=True)
    if cfg.debug.startup_digest:
        startup["weights_digest"] = consolidated_digest(engine)
    return engine, startup


def consolidated_digest(engine) -> str:
    """sha256 of the full fp32 weights (names in order, then bytes), the same on every rank."""
    h = hashlib.sha256()
    for name, t in sorted(engine.consolidated_state_dict().items()):
        h.update(name.encode())
        h.update(t.float().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@record
def main(argv: list[str] | None = None, early: tuple[int, ...] | list[int] = ()) -> int:
    """One rank, start to end; `early`: the stop signals recorded while it imported
    (launcher/rank/__main__.py). Returns the exit code."""
    started = process_start_time()
    offline()  # also for a rank started by hand: nothing is fetched from a hub
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m launcher.rank RUN_DIR | RUN_DIR/config.yaml", file=sys.stderr)
        return 2
    target = Path(argv[0]).resolve()
    run_dir = target if target.is_dir() else target.parent
    cfg = C.load_frozen(target)
    preemption = Preemption(run_dir).install(early)  # before anything slow: a signal now still stops cleanly

    _single_process_env()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with contextlib.ExitStack() as held:
        # pdsh starts DeepSpeed's ranks on several nodes: not the launcher's descendants, nor
        # its environment; its launcher holds the lock (docs/reliability.md, 7)
        by_pdsh = cfg.cluster.runner == C.Runner.deepspeed and cfg.cluster.nnodes > 1
        if rank == 0 and not by_pdsh:  # one launch per run directory, also without the launcher
            try:
                held.enter_context(runlock.rank_hold(lock_folders(cfg, run_dir)))
            except runlock.Held as e:
                print(f"error: {e}", file=sys.stderr, flush=True)
                return 2
            except OSError as e:  # a full or read-only disk: one line, not a traceback
                print(f"error: cannot lock {e.filename or run_dir}: {e.strerror or e}", file=sys.stderr, flush=True)
                return 2
        return run_rank(cfg, run_dir, rank, world_size, preemption, started)


def join_group(
    cfg: C.Config, run_dir: Path, rank: int, world_size: int, preemption: Preemption
) -> tuple[torch.device, int, int]:
    """This rank's device and threads, the process group joined (and the CPU group the stop signal
    agrees on): (device, local rank, the collectives' timeout in seconds)."""
    local_rank = int(os.environ["LOCAL_RANK"])
    device = local_device(local_rank)
    backend = backend_for(device) if cfg.dist.backend == C.Backend.auto else cfg.dist.backend.value
    if device.type == "cpu" and cfg.cluster.cpu_threads:
        torch.set_num_threads(cfg.cluster.cpu_threads)
    use_tf32(device, cfg.precision.tf32)
    # The collectives' own timeout is the backstop; the watchdog (launcher/rank/watchdog.py)
    # fires first, at dist.timeout_s, and names the silent rank.
    backstop = cfg.dist.timeout_s + max(30, cfg.dist.timeout_s // 2)
    if backend == "nccl" and cfg.dist.flight_recorder:  # where NCCL's own timeout dump goes (launch/start/argv.py)
        (run_dir / COMM_TRACE).mkdir(exist_ok=True)
    dist.init_process_group(
        backend,
        store=job_store(rank, world_size, backstop),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=backstop),
        device_id=device if device.type == "cuda" else None,
    )
    if backend != "gloo":  # stop-signal agreement runs on the CPU, never syncing the GPU
        preemption.group = dist.new_group(backend="gloo")
    return device, local_rank, backstop


def run_rank(cfg: C.Config, run_dir: Path, rank: int, world_size: int, preemption: Preemption, started: float) -> int:
    """This rank's run: device, process group, checkpointer, engine and data, the loop; the group torn down."""
    device, local_rank, backstop = join_group(cfg, run_dir, rank, world_size, preemption)
    try:
        ckpt = Checkpointer(
            root_of(cfg, run_dir),
            cfg.checkpoint.keep,
            rank,
            world_size,
            debug=cfg.debug,
            run_id=cfg.checkpoint.run_id,
            about=describe(cfg) if rank == 0 else None,
            async_save=cfg.checkpoint.async_save,
            timeout=timedelta(seconds=backstop),
        )
        start_from = ckpt.resolve(cfg.checkpoint.resume)
        if start_from is not None and manifest_step(start_from) >= cfg.train.steps:
            # command.sh run again, a requeued job of a finished run: nothing is built or written
            if rank == 0:
                print(
                    f"nothing to train: {start_from} is at step {manifest_step(start_from)} of "
                    f"train.steps={cfg.train.steps}; raise train.steps to train on",
                    flush=True,
                )
            return 0
        provenance.record_hosts(run_dir, rank, world_size, preemption.group)  # which hosts, which code
        engine, startup = start(cfg, device, rank, world_size, local_rank, run_dir, started)
        accum = D.grad_accum(cfg, world_size)
        dp_size = D.data_parallel_size(cfg, world_size)
        dataset = build_dataset(cfg, run_dir)
        ckpt.data = dataset.fingerprint() if hasattr(dataset, "fingerprint") else None  # compared at resume
        job = Job(
            cfg=cfg,
            run_dir=run_dir,
            engine=engine,
            dataset=dataset,
            device=device,
            rank=rank,
            world_size=world_size,
            dp_rank=D.degrees(cfg, world_size).dp_rank(rank),
            dp_size=dp_size,
            grad_accum=accum,
            flops_per_token=models.flops_per_token(cfg, cfg.train.seq_len),
            compute_dtype=autocast_dtype(cfg.precision.name.value),
            preemption=preemption,
            startup=startup,
            checkpointer=ckpt,
            start_from=start_from,
        )
        code = run(job)
    finally:
        # gloo aborts at exit without this, and schedulers then mark the job failed.
        dist.destroy_process_group()
    return code

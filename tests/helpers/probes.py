"""What the probes run under torchrun share (tests/helpers/*_probe.py): a rank's start
and each case's run folder."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch.distributed as dist

from launcher.host import deepspeed_env
from launcher.parallel import ds_config


def join(prefix: str) -> tuple[int, int, Path]:
    """DeepSpeed's environment, the gloo group, and a scratch folder rank 0 made:
    (rank, world size, folder)."""
    deepspeed_env()
    dist.init_process_group("gloo")
    scratch = [tempfile.mkdtemp(prefix=prefix) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(scratch)
    return dist.get_rank(), dist.get_world_size(), Path(scratch[0])


def run_dir(cfg, folder: Path, rank: int, world: int) -> Path:
    """A case's run folder, made by rank 0 with the launch side's ds_config.json for a zero
    recipe; every rank waits for it."""
    if rank == 0:
        folder.mkdir()
        if cfg.recipe.engine == "zero":
            (folder / ds_config.FILE).write_text(ds_config.text(ds_config.launch_config(cfg, world, cuda=False)))
    dist.barrier()
    return folder

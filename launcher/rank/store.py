"""The job's key-value store (torch.distributed's TCPStore), shared by the process group
and the watchdog: one module of its own, which both import."""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist


def job_store(rank: int | None, world_size: int, timeout_s: float) -> dist.Store:
    """The job's key-value store, namespaced per torchrun attempt.

    torchrun hosts one store for the job (TORCHELASTIC_USE_AGENT_STORE) and keeps it across
    restarts of the group: without a fresh namespace a restarted rank can read a dead
    peer's address left by the previous attempt and fail to connect (seen with gloo).
    Without torchrun, rank 0 hosts the store, as env:// would. `rank=None`: another
    client (the watchdog's own connection)."""
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    host = rank == 0 and not agent_hosts
    base = dist.TCPStore(
        addr,
        port,
        world_size if host else None,
        is_master=host,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        multi_tenant=host,
    )
    return dist.PrefixStore(f"launcher/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", base)

"""Multi-node runs started by hand: the nodes' launchers meet before any torchrun starts.

`make train ... cluster.nnodes=N cluster.node_rank=K cluster.master_addr=A cluster.master_port=P`
on every node. The launcher of node 0 hosts a TCPStore at A:P; each launcher registers its
node rank, host and run directory there and waits at most `cluster.join_timeout_s` for the
others. What goes wrong is said in one line naming the node: a node that never joined, a
node_rank given twice, a node with another run directory or other settings.

The same store then serves torchrun's c10d rendezvous: node 0's agent finds the port taken
and joins as a client (torch's own fallback when the endpoint is local), so the run needs
one open port, and node 0's launcher keeps the store until every node has finished.
"""

from __future__ import annotations

import hashlib
import json
import socket
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from launcher import config as C
from launcher.launch.start.argv import join_timeout

POLL_S = 0.2
DONE_WAIT_S = 60  # node 0 keeps the store this long at most for the others to finish


def check_master_addr(cfg: C.Config) -> None:
    """Before anything starts, on the launch side: cluster.master_addr must resolve, and on
    node 0, which hosts the rendezvous there, be one of this machine's own addresses
    (checked by binding a socket to it: nothing is sent). A wrong address otherwise costs
    the whole join timeout and a page of c10d retries. ConfigError, one line."""
    c = cfg.cluster
    key = "cluster.master_addr"
    try:
        found = {str(info[4][0]) for info in socket.getaddrinfo(c.master_addr, c.master_port, type=socket.SOCK_STREAM)}
    except (socket.gaierror, UnicodeError) as e:
        raise C.ConfigError(
            key,
            c.master_addr,
            f"does not resolve ({e.strerror if hasattr(e, 'strerror') else e}); "
            f"give node 0's address or hostname, the same on every node",
        ) from None
    if c.node_rank != 0:
        return
    for addr in sorted(found):
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((addr, 0))
                return
            except OSError:
                continue
    raise C.ConfigError(
        key,
        c.master_addr,
        f"resolves to {', '.join(sorted(found))}, none of which is this "
        f"machine's; node 0 (cluster.node_rank=0) hosts the rendezvous at "
        f"cluster.master_addr:{c.master_port}, so it must be node 0's own address",
    )


class RendezvousFailed(Exception):
    """A node is missing or does not match; the message names it."""


def config_digest(cfg: C.Config) -> str:
    """The settings every node must share: all but the node's own rank, address and
    environment (interface names differ between machines), how long it waits for node 0,
    and the run id node 0 settles."""
    same = replace(
        cfg,
        cluster=replace(cfg.cluster, node_rank=0, local_addr=None, env={}, rdzv_timeout_s=0),
        checkpoint=replace(cfg.checkpoint, run_id=None),
    )
    return hashlib.sha256(C.to_yaml(same).encode()).hexdigest()[:16]


class NodeRendezvous:
    def __init__(self, cfg: C.Config, run_dir: Path):
        c = cfg.cluster
        self.nnodes, self.rank = c.nnodes, c.node_rank
        self.addr, self.port = c.master_addr, c.master_port
        self.timeout = join_timeout(cfg)
        self.reach_timeout = c.rdzv_timeout_s
        self.me = {"host": socket.gethostname(), "run_dir": str(run_dir), "config": config_digest(cfg)}
        self.where = f"the rendezvous at {self.addr}:{self.port}"
        self.store: Any = None  # a TCPStore once joined
        self.nodes: dict[int, dict] = {}

    # ------------------------------------------------------------------ enter / exit
    def __enter__(self) -> "NodeRendezvous":
        import torch.distributed as dist  # local: torch (launch side)

        deadline = time.monotonic() + self.timeout
        if self.rank == 0:
            try:
                self.store = dist.TCPStore(
                    self.addr,
                    self.port,
                    is_master=True,
                    wait_for_workers=False,
                    timeout=timedelta(seconds=self.timeout),
                )
            except Exception as e:  # noqa: BLE001 - the store's errors are RuntimeError or DistNetworkError
                raise RendezvousFailed(
                    f"node 0 cannot host {self.where} (is the port in use, or the address "
                    f"not this machine's?): {str(e).splitlines()[0]}"
                ) from None
        else:
            self._wait_reachable(min(deadline, time.monotonic() + self.reach_timeout))
            self.store = dist.TCPStore(
                self.addr, self.port, is_master=False, timeout=timedelta(seconds=max(1.0, deadline - time.monotonic()))
            )
        self._register()
        if self.rank == 0:
            self._gather(deadline)
        else:
            self._await_go(deadline)
        return self

    def __exit__(self, *exc) -> None:
        if self.store is None:
            return
        try:
            if self.rank == 0:  # the others' agents still use the store until they are done
                others = [self._key(f"done/{k}") for k in range(1, self.nnodes)]
                end = time.monotonic() + DONE_WAIT_S
                while others and not self.store.check(others) and time.monotonic() < end:
                    time.sleep(POLL_S)
            else:
                self.store.set(self._key(f"done/{self.rank}"), "1")
        except Exception:  # noqa: BLE001 - node 0 already gone: nothing left to tell it
            pass
        self.store = None

    # ------------------------------------------------------------------ steps
    def _key(self, name: str) -> str:
        return f"launcher/nodes/{name}"

    def _wait_reachable(self, deadline: float) -> None:
        """Poll the port quietly (a TCPStore client logs every failed try)."""
        while True:
            try:
                with socket.create_connection((self.addr, self.port), timeout=2):
                    return
            except OSError:
                if time.monotonic() >= deadline:
                    waited = min(self.timeout, self.reach_timeout)
                    raise RendezvousFailed(
                        f"node {self.rank} of {self.nnodes}: node 0 never opened {self.where} within "
                        f"{waited} s (cluster.rdzv_timeout_s): start node 0 first (it hosts the rendezvous), "
                        f"check cluster.master_addr and cluster.master_port, or raise cluster.rdzv_timeout_s"
                    ) from None
                time.sleep(POLL_S)

    def _register(self) -> None:
        claims = self.store.add(self._key(f"claims/{self.rank}"), 1)
        if claims > 1:
            raise RendezvousFailed(
                f"cluster.node_rank={self.rank} is given to two nodes (this one: "
                f"{self.me['host']}); give each node its own rank in 0..{self.nnodes - 1}"
            )
        self.store.set(self._key(f"node/{self.rank}"), json.dumps(self.me))

    def _gather(self, deadline: float) -> None:
        keys = {k: self._key(f"node/{k}") for k in range(self.nnodes)}
        while not self.store.check(list(keys.values())):
            if time.monotonic() >= deadline:
                missing = [k for k, key in keys.items() if not self.store.check([key])]
                joined = [k for k in keys if k not in missing]
                self._read(joined)
                self._abort(
                    f"node{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of {self.nnodes} "
                    f"never joined {self.where} within {self.timeout} s (cluster.join_timeout_s); "
                    f"joined: {self.describe()}"
                )
            time.sleep(POLL_S)
        self._read(range(self.nnodes))
        for k, node in self.nodes.items():
            if node["run_dir"] != self.me["run_dir"]:
                self._abort(
                    f"node {k} ({node['host']}) uses the run directory {node['run_dir']}, node 0 uses "
                    f"{self.me['run_dir']}: give every node the same hydra.run.dir (a shared folder)"
                )
            if node["config"] != self.me["config"]:
                self._abort(
                    f"node {k} ({node['host']}) has other settings than node 0: launch every node with "
                    f"the same overrides (only cluster.node_rank, local_addr and env may differ)"
                )
        self.store.set(self._key("go"), "1")

    def _await_go(self, deadline: float) -> None:
        go, abort = self._key("go"), self._key("abort")
        while True:
            try:
                if self.store.check([abort]):
                    message = self.store.get(abort).decode()
                    self.store.add(self._key("abort_seen"), 1)
                    raise RendezvousFailed(message)
                if self.store.check([go]):
                    self._read(range(self.nnodes))
                    return
            except RendezvousFailed:
                raise
            except Exception:  # noqa: BLE001 - the store went away with node 0
                raise RendezvousFailed(
                    f"node {self.rank} of {self.nnodes}: node 0 left {self.where} "
                    f"before all nodes had joined (see node 0's output)"
                ) from None
            if time.monotonic() >= deadline + 5:  # node 0 decides at the deadline; allow it to say so
                raise RendezvousFailed(
                    f"node {self.rank} of {self.nnodes}: node 0 did not report all nodes "
                    f"at {self.where} within {self.timeout} s (cluster.join_timeout_s)"
                )
            time.sleep(POLL_S)

    def _read(self, ranks) -> None:
        for k in ranks:
            self.nodes[k] = json.loads(self.store.get(self._key(f"node/{k}")))

    def _abort(self, message: str) -> None:
        """Tell the nodes that did come (they are waiting on this store), then fail."""
        self.store.set(self._key("abort"), message)
        waiting = len(self.nodes) - 1
        end = time.monotonic() + 3
        while waiting > 0 and time.monotonic() < end and self.store.add(self._key("abort_seen"), 0) < waiting:
            time.sleep(POLL_S)
        raise RendezvousFailed(message)

    def describe(self) -> str:
        return ", ".join(f"node {k} on {n['host']}" for k, n in sorted(self.nodes.items())) or "none"

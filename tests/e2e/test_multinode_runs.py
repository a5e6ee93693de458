"""Multi-node without a scheduler, on this one machine: two launchers, one per "node",
each with its own cluster.node_rank, meet at cluster.master_addr:master_port and train
together exactly as one node with the same world size. A node that never comes is named."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from runs import REPO, assert_same_training, in_fp32, launch

from launcher.launch.rundir.prepare import free_port

# Same work either way: world size 2, one thread per rank (thread counts change float sums).
COMMON = in_fp32(
    [
        "train.steps=10",
        "optim.warmup_steps=2",
        "logger=none",
        "logger.log_every=1",
        "checkpoint.every=1000",
        "cluster.cpu_threads=1",
    ]
)


def start_node(
    run_dir: Path, rank: int, port: int, *extra: str, addr: str = "127.0.0.1", netns: str | None = None
) -> subprocess.Popen:
    argv = (["ip", "netns", "exec", netns] if netns else []) + [
        sys.executable,
        "-m",
        "launcher",
        "train",
        f"hydra.run.dir={run_dir}",
        *COMMON,
        "cluster.nnodes=2",
        f"cluster.node_rank={rank}",
        f"cluster.master_addr={addr}",
        f"cluster.master_port={port}",
        "cluster.nproc_per_node=1",
        *extra,
    ]
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> Path:
    """The reference: one node with both ranks."""
    run_dir = tmp_path_factory.mktemp("reference") / "one-node"
    launch(*COMMON, "cluster.nproc_per_node=2", run_dir=run_dir)
    return run_dir


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


@pytest.mark.slow
def test_two_nodes_train_as_one_node_with_the_same_world_size(one_node, tmp_path):
    two = tmp_path / "two-nodes"
    port = free_port()
    nodes = [start_node(two, rank, port) for rank in (1, 0)]  # the non-host node first: it waits
    results = [finish(p) for p in nodes]
    for rc, out, err in results:
        assert rc == 0, f"{out[-2000:]}\n{err[-4000:]}"
    node1_out, node0_out = results[0][1], results[1][1]
    assert "node 0: all 2 nodes joined" in node0_out and "node 1: all 2 nodes joined" in node1_out
    # Each node wrote its own command; both rendezvous at node 0's address.
    assert "--node-rank=0" in (two / "command.sh").read_text()
    assert "--node-rank=1" in (two / "command.node1.sh").read_text()
    assert f"--rdzv-endpoint=127.0.0.1:{port}" in (two / "command.node1.sh").read_text()

    assert_same_training(one_node, two, 10)


@pytest.fixture
def two_namespaces():
    """Two network namespaces joined by a veth pair: two "machines" with their own
    interface and address, so the rendezvous and the collectives cross a real link."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make network namespaces")
    tag = uuid.uuid4().hex[:6]
    names, links, addrs = [f"lt{tag}a", f"lt{tag}b"], [f"vt{tag}a", f"vt{tag}b"], ["10.231.7.1", "10.231.7.2"]

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    try:
        for ns in names:
            ip("netns", "add", ns)
        ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for ns, link, addr in zip(names, links, addrs):
            ip("link", "set", link, "netns", ns)
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", link)
            ip("-n", ns, "link", "set", link, "up")
            ip("-n", ns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as e:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"cannot make network namespaces here: {e.stderr.strip()}")
    yield list(zip(names, links, addrs))
    for ns in names:  # the veth pair goes with them
        subprocess.run(["ip", "netns", "del", ns], check=True)


@pytest.mark.slow
def test_two_nodes_across_a_veth_link_train_as_one_node(one_node, two_namespaces, tmp_path):
    """Stretch: each node in its own network namespace; node 0 is reached at its veth
    address, the ranks talk gloo over the veth (GLOO_SOCKET_IFNAME), c10d hands out ranks."""
    two = tmp_path / "two-nodes"
    port = 29555  # any: the namespaces have only these two processes' ports
    master = two_namespaces[0][2]
    nodes = [
        start_node(
            two,
            rank,
            port,
            f"cluster.local_addr={addr}",
            f"+cluster.env.GLOO_SOCKET_IFNAME={link}",
            addr=master,
            netns=ns,
        )
        for rank, (ns, link, addr) in reversed(list(enumerate(two_namespaces)))
    ]
    for proc in nodes:
        rc, out, err = finish(proc)
        assert rc == 0, f"{out[-2000:]}\n{err[-4000:]}"
        assert "all 2 nodes joined" in out
    assert f"--local-addr={two_namespaces[1][2]}" in (two / "command.node1.sh").read_text()
    assert f"GLOO_SOCKET_IFNAME={two_namespaces[1][1]}" in (two / "command.node1.sh").read_text()
    assert_same_training(one_node, two, 10)
    # The gradients crossed the link: 10 all-reduces of 885,888 fp32 gradients each way.
    ns, link, _ = two_namespaces[1]
    stats = json.loads(
        subprocess.run(
            ["ip", "-n", ns, "-s", "-j", "link", "show", "dev", link], capture_output=True, text=True, check=True
        ).stdout
    )[0]["stats64"]
    assert stats["tx"]["bytes"] > 10 * 885_888 * 4 / 2 and stats["rx"]["bytes"] > 10 * 885_888 * 4 / 2, stats


@pytest.mark.slow
def test_nodes_that_cannot_train_together_are_named(tmp_path):
    """Node 0 alone names node 1; node 1 alone (elsewhere) names node 0; two nodes with other
    settings (here: steps) are told so. No rank starts in any of them."""
    short = ["cluster.join_timeout_s=4"]
    port = free_port()
    procs = [
        start_node(tmp_path / "a", 0, free_port(), *short),
        start_node(tmp_path / "b", 1, free_port(), "cluster.rdzv_timeout_s=3"),
        start_node(tmp_path / "c", 1, port, "train.steps=11"),
        start_node(tmp_path / "c", 0, port),
    ]
    (rc0, _, err0), (rc1, _, err1), (rc2, _, err2), (rc3, _, err3) = [finish(p, 120) for p in procs]
    assert rc0 == 1 and "error: node 1 of 2 never joined the rendezvous at 127.0.0.1:" in err0, err0
    assert "within 4 s (cluster.join_timeout_s); joined: node 0 on" in err0
    # (node 1 alone: dist.timeout_s=600 would be the join timeout; the rendezvous answers or not within 3 s)
    assert rc1 == 1 and "error: node 1 of 2: node 0 never opened the rendezvous" in err1, err1
    assert "within 3 s (cluster.rdzv_timeout_s): start node 0 first" in err1, err1
    assert rc2 == rc3 == 1
    for err in (err2, err3):
        assert "node 1 (" in err and "has other settings than node 0" in err, err
    for folder in (tmp_path / "a", tmp_path / "b", tmp_path / "c"):
        assert not (folder / "metrics.jsonl").exists() and not (folder / "checkpoints").exists()
    assert "Traceback" not in err0 + err1 + err2 + err3

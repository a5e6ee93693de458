"""Multi-node without a scheduler, on this one machine: two launchers, one per "node",
each with its own cluster.node_rank, meet at cluster.master_addr:master_port and train
together exactly as one node with the same world size. A node that never comes is named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, assert_same_training, launch
from launcher.cli import free_port

# Same work either way: world size 2, one thread per rank (thread counts change float sums).
COMMON = ["train.steps=10", "optim.warmup_steps=2", "logger=none", "logger.log_every=1", "checkpoint.every=1000",
          "cluster.cpu_threads=1"]


def start_node(run_dir: Path, rank: int, port: int, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "launcher", "train", f"hydra.run.dir={run_dir}", *COMMON, "cluster.nnodes=2",
            f"cluster.node_rank={rank}", "cluster.master_addr=127.0.0.1", f"cluster.master_port={port}",
            "cluster.nproc_per_node=1", *extra]
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


@pytest.mark.slow
def test_two_nodes_train_as_one_node_with_the_same_world_size(tmp_path):
    one, two = tmp_path / "one-node", tmp_path / "two-nodes"
    port = free_port()
    nodes = [start_node(two, rank, port) for rank in (1, 0)]  # the non-host node first: it waits
    launch(*COMMON, "cluster.nproc_per_node=2", run_dir=one)
    results = [finish(p) for p in nodes]
    for rc, out, err in results:
        assert rc == 0, f"{out[-2000:]}\n{err[-4000:]}"
    node1_out, node0_out = results[0][1], results[1][1]
    assert "node 0: all 2 nodes joined" in node0_out and "node 1: all 2 nodes joined" in node1_out
    # Each node wrote its own command; both rendezvous at node 0's address.
    assert "--node-rank=0" in (two / "command.sh").read_text()
    assert "--node-rank=1" in (two / "command.node1.sh").read_text()
    assert f"--rdzv-endpoint=127.0.0.1:{port}" in (two / "command.node1.sh").read_text()

    assert_same_training(one, two, 10)


@pytest.mark.slow
def test_a_node_that_never_joins_is_named(tmp_path):
    """Node 0 alone names node 1; node 1 alone (elsewhere) names node 0. No rank starts."""
    short = ["cluster.join_timeout_s=4"]
    alone0 = start_node(tmp_path / "a", 0, free_port(), *short)
    alone1 = start_node(tmp_path / "b", 1, free_port(), *short)
    rc0, out0, err0 = finish(alone0, 120)
    rc1, out1, err1 = finish(alone1, 120)
    assert rc0 == 1 and "error: node 1 of 2 never joined the rendezvous at 127.0.0.1:" in err0, err0
    assert "within 4 s (cluster.join_timeout_s); joined: node 0 on" in err0
    assert rc1 == 1 and "error: node 1 of 2: node 0 never opened the rendezvous" in err1, err1
    for folder in (tmp_path / "a", tmp_path / "b"):
        assert not (folder / "metrics.jsonl").exists() and not (folder / "checkpoints").exists()
    assert "Traceback" not in err0 + err1


@pytest.mark.slow
def test_nodes_that_disagree_are_refused_by_name(tmp_path):
    """Two nodes with different settings (here: steps) are told so before any rank starts."""
    port = free_port()
    n1 = start_node(tmp_path / "run", 1, port, "train.steps=11")
    n0 = start_node(tmp_path / "run", 0, port)
    (rc0, _, err0), (rc1, _, err1) = finish(n0, 120), finish(n1, 120)
    assert rc0 == rc1 == 1
    for err in (err0, err1):
        assert "node 1 (" in err and "has other settings than node 0" in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_multi_node_needs_one_run_directory_for_all_nodes(tmp_path, capsys, monkeypatch):
    """The default run directory is a timestamp: it would differ between nodes."""
    from launcher import cli

    monkeypatch.chdir(tmp_path)
    code = cli.main(["cluster.nnodes=2", "cluster.node_rank=1", "cluster.master_port=29400"])
    err = capsys.readouterr().err
    assert code == 2 and "error: hydra.run.dir=(default: a timestamp): a run over cluster.nnodes=2 nodes" in err, err
    assert not (tmp_path / "outputs").exists()

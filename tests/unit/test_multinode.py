"""Multi-node by hand, checked before anything starts: every node needs the same run
directory. The nodes training together: tests/e2e/test_multinode_runs.py."""

from __future__ import annotations


def test_multi_node_needs_one_run_directory_for_all_nodes(tmp_path, capsys, monkeypatch):
    """The default run directory is a timestamp: it would differ between nodes."""
    from launcher.launch import cli

    monkeypatch.chdir(tmp_path)
    code = cli.main(["cluster.nnodes=2", "cluster.node_rank=1", "cluster.master_port=29400"])
    err = capsys.readouterr().err
    assert code == 2 and "error: hydra.run.dir=(default: a timestamp): a run over cluster.nnodes=2 nodes" in err, err
    assert not (tmp_path / "outputs").exists()

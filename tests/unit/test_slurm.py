"""`launcher submit` without a cluster: --dry-run prints the script (golden) and submits
nothing; no sbatch is refused before anything is written. Jobs on a real Slurm:
tests/e2e/test_slurm_runs.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from golden import check_golden
from runs import FAST, REPO

from launcher.launch import cli

# The jobs: 2 gloo ranks on the one node (2 CPUs), W&B offline.
JOB = ["cluster.nproc_per_node=2", "cluster.cpus_per_task=2", *FAST]


# ----------------------------------------------------------------------------- no cluster
# The golden scripts import the job's snapshot of the code (cluster.snapshot_code) through
# PYTHONSAFEPATH, which Python 3.10 lacks: there the script goes without those two lines.
SNAPSHOT = pytest.mark.skipif(
    sys.version_info < (3, 11), reason="the goldens hold the snapshot's PYTHONSAFEPATH (3.11+)"
)


@SNAPSHOT
def test_dry_run_prints_the_script_and_submits_nothing(capsys, monkeypatch):
    """The 4-node job of docs/launching.md, as `make submit ... --dry-run` prints it."""
    monkeypatch.chdir(REPO)
    run_dir = Path("/tmp/launcher-golden/four-nodes")  # fixed: the rendezvous id hashes it
    code = cli.main(
        [
            "submit",
            "recipe=ddp",
            "cluster=slurm",
            "cluster.nnodes=4",
            "cluster.gpus_per_node=8",
            "cluster.cpus_per_task=64",
            "cluster.partition=gpu",
            "cluster.time=24:00:00",
            "cluster.account=proj42",
            "cluster.mem=0",
            "cluster.exclusive=true",
            "+cluster.env.NCCL_SOCKET_IFNAME=ib0",
            "cluster.setup=['module load cuda/12.4']",
            f"hydra.run.dir={run_dir}",
            "--dry-run",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert not run_dir.exists(), "--dry-run wrote a run directory"
    text = out.replace(sys.executable, "/venv/bin/python").replace(str(REPO), "/repo")
    check_golden("submit_dry_run_4_nodes.sbatch", text)
    assert subprocess.run(["bash", "-n"], input=out, text=True).returncode == 0, "the script is not valid bash"


@SNAPSHOT
def test_the_rehearsed_405b_layout_renders_as_a_64_node_job(capsys, monkeypatch):
    """The 405B layout scripts/rehearse_matrix.py rehearses at 512 ranks (docs/memory.md 5),
    pp=16 x tp=8 x fsdp, submitted: 64 nodes of 8 GPUs, one torchrun agent a node, the c10d rendezvous (the
    ranks' store) hosted on the allocation's first node, every node given
    cluster.join_timeout_s to join; the same overrides `make rehearse` took."""
    monkeypatch.chdir(REPO)
    # A 405B run keeps 4 checkpoints of 6 TB on the cluster's parallel filesystem; this
    # machine's disk stands in for it with that filesystem's free space (1 PiB).
    from launcher.launch.rundir import prepare as rundir

    class ParallelFilesystem:
        free = 2**50

    monkeypatch.setattr(rundir.shutil, "disk_usage", lambda path: ParallelFilesystem)
    run_dir = Path("/tmp/launcher-golden/llama3-405b")  # fixed: the rendezvous id hashes it
    code = cli.main(
        [
            "submit",
            "model=llama3_405b",
            "recipe=pp_fsdp",
            "parallel.pp=16",
            "parallel.tp=8",
            "parallel.sequence_parallel=true",
            "parallel.pp_microbatches=32",
            "train.micro_batch=32",
            "cluster=slurm",
            "cluster.nnodes=64",
            "cluster.gpus_per_node=8",
            "cluster.cpus_per_task=96",
            "cluster.partition=gpu",
            "cluster.time=48:00:00",
            "cluster.mem=0",
            "cluster.exclusive=true",
            "cluster.join_timeout_s=900",
            "train.seq_len=8192",
            "train.activation_checkpointing=full",
            "+cluster.env.NCCL_SOCKET_IFNAME=ib0",
            f"hydra.run.dir={run_dir}",
            "--dry-run",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and not run_dir.exists()
    text = out.replace(sys.executable, "/venv/bin/python").replace(str(REPO), "/repo")
    check_golden("submit_dry_run_64_nodes_405b.sbatch", text)
    assert "#SBATCH --nodes=64" in text and "--nproc-per-node=8" in text and "--rdzv-conf=join_timeout=900" in text
    assert 'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in text
    # The collectives' flight recorder, dumped into the run directory on a hang or an NCCL timeout.
    assert "export TORCH_FR_BUFFER_SIZE=2000" in text and "export TORCH_NCCL_DUMP_ON_TIMEOUT=1" in text
    assert f"export TORCH_FR_DUMP_TEMP_FILE={run_dir}/comm_trace/rank_" in text
    assert subprocess.run(["bash", "-n"], input=out, text=True).returncode == 0, "the script is not valid bash"


def test_submit_without_sbatch_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no Slurm client tools
    monkeypatch.chdir(REPO)
    code = cli.main(["submit", *JOB, f"hydra.run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: cluster.scheduler=slurm: sbatch not found"), err
    assert not (tmp_path / "run").exists()

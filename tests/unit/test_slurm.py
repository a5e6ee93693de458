"""`launcher submit` without a cluster: --dry-run prints the script (golden) and submits
nothing; no sbatch is refused before anything is written. Jobs on a real Slurm:
tests/e2e/test_slurm_runs.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


from runs import FAST, REPO
from launcher.launch import cli
from golden import check_golden


# The jobs: 2 gloo ranks on the one node (2 CPUs), W&B offline.
JOB = ["cluster.nproc_per_node=2", "cluster.cpus_per_task=2", *FAST]


# ----------------------------------------------------------------------------- no cluster
def test_dry_run_prints_the_script_and_submits_nothing(capsys, monkeypatch):
    """The 4-node job of the README, as `make submit ... --dry-run` prints it."""
    monkeypatch.chdir(REPO)
    run_dir = Path("/tmp/launcher-golden/four-nodes")  # fixed: the rendezvous id hashes it
    code = cli.main(["submit", "recipe=ddp", "cluster=slurm", "cluster.nnodes=4", "cluster.gpus_per_node=8",
                     "cluster.cpus_per_task=64", "cluster.partition=gpu", "cluster.time=24:00:00",
                     "cluster.account=proj42", "cluster.mem=0", "cluster.exclusive=true",
                     "+cluster.env.NCCL_SOCKET_IFNAME=ib0", "cluster.setup=['module load cuda/12.4']",
                     f"hydra.run.dir={run_dir}", "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0
    assert not run_dir.exists(), "--dry-run wrote a run directory"
    text = out.replace(sys.executable, "/venv/bin/python").replace(str(REPO), "/repo")
    check_golden("submit_dry_run_4_nodes.sbatch", text)
    assert subprocess.run(["bash", "-n"], input=out, text=True).returncode == 0, "the script is not valid bash"


def test_submit_without_sbatch_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no Slurm client tools
    monkeypatch.chdir(REPO)
    code = cli.main(["submit", *JOB, f"hydra.run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: cluster.scheduler=slurm: sbatch not found"), err
    assert not (tmp_path / "run").exists()

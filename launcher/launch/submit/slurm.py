"""Slurm, the impure half: what the job's nodes look like (for validation on a login node
that has no GPUs), and handing RUN_DIR/job.sbatch to sbatch. The script itself is rendered
by the pure `launcher.launch.start.argv.sbatch_script`.

sbatch runs with the user's environment (less what the launcher set for itself), so SLURM_CONF, SBATCH_* defaults and the user's
Slurm configuration apply as they would by hand. It runs inside the run directory: the
script's log path (slurm-%j.out) is relative, so no path has to survive sbatch's own
parsing of #SBATCH lines.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from launcher import config as C
from launcher import user_env
from launcher.host import HostInfo
from launcher.provenance import PROJECT

JOB_ID_FILE = "slurm_job_id"
SCRIPT = "job.sbatch"


def node_host(cfg: C.Config, here: HostInfo) -> HostInfo:
    """The compute node the job asks for, in place of this (login) machine: GPUs from
    cluster.gpus_per_node, CPUs from cluster.cpus_per_task (else like this machine)."""
    gpus = cfg.cluster.gpus_per_node or 0
    return HostInfo(cuda=gpus > 0, gpus=gpus, cpus=cfg.cluster.cpus_per_task or here.cpus)


def check_client() -> None:
    """sbatch must be reachable before anything is written."""
    if shutil.which("sbatch") is None:
        raise C.ConfigError(
            "cluster.scheduler",
            "slurm",
            "sbatch not found on PATH: submit from a machine with Slurm's client tools "
            "(or scripts/slurm/local_cluster.sh here)",
        )


class SubmitError(Exception):
    """sbatch refused the job; the message is sbatch's own."""


def submit(run_dir: Path) -> str:
    """`sbatch --parsable job.sbatch` in RUN_DIR; writes and returns the job id. sbatch gets
    the user's environment, less what the launch side set for this machine
    (launcher.user_env: DS_ACCELERATOR=cpu on a login node without GPUs stays there)."""
    proc = subprocess.run(["sbatch", "--parsable", SCRIPT], cwd=run_dir, capture_output=True, text=True, env=user_env())
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        raise SubmitError(" | ".join(lines) or f"sbatch exited {proc.returncode}")
    job_id = proc.stdout.strip().split(";")[0]  # --parsable: "id" or "id;cluster"
    (run_dir / JOB_ID_FILE).write_text(job_id + "\n")
    return job_id


CODE = "code"
PACKAGES = ("launcher", "engines")  # what a rank imports of the project


def code_dir(cfg: C.Config, run_dir: Path) -> str | None:
    """Where the job imports the project from (RUN_DIR/code), or None: cluster.snapshot_code
    off, or a Python without PYTHONSAFEPATH (3.10), which says so in one line."""
    if not cfg.cluster.snapshot_code:
        return None
    why = (
        "needs Python 3.11+ (PYTHONSAFEPATH)"
        if sys.version_info < (3, 11)
        else "cannot name a run directory with ':' in PYTHONPATH"
        if ":" in str(run_dir)
        else None
    )
    if why:
        print(
            f"note: cluster.snapshot_code {why}; the job imports the checkout as it is when the job starts",
            file=sys.stderr,
        )
        return None
    return str(run_dir / CODE)


def snapshot_code(run_dir: Path) -> Path:
    """Copy the project's packages into RUN_DIR/code (a new copy replaces an earlier one
    whole: written beside it, then renamed). Bytecode caches are left out."""
    dest, fresh, old = run_dir / CODE, run_dir / f".{CODE}.new", run_dir / f".{CODE}.old"
    for leftover in (fresh, old):
        shutil.rmtree(leftover, ignore_errors=True)
    for name in PACKAGES:
        shutil.copytree(PROJECT / name, fresh / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    if dest.exists():
        dest.rename(old)
    fresh.rename(dest)
    shutil.rmtree(old, ignore_errors=True)
    return dest


def log_path(run_dir: Path, job_id: str) -> Path:
    """Where the job writes (#SBATCH --output=slurm-%j.out, relative to the run directory)."""
    return run_dir / f"slurm-{job_id}.out"

"""A real single-node Slurm for the tests: scripts/slurm/local_cluster.sh (the script people
use to try it), run as this fixture's child. It starts munged, slurmctld and slurmd in a
folder under /tmp (munged wants every folder above its socket searchable by others, which
pytest's tmp_path is not) and, on SIGTERM, stops exactly those daemons by PID.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from runs import REPO

SCRIPT = REPO / "scripts" / "slurm" / "local_cluster.sh"
TOOLS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "sinfo")


@dataclass
class Cluster:
    folder: Path
    env: dict[str, str]
    """os.environ plus SLURM_CONF: what a client needs."""

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True, check=check, timeout=60)

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (finished jobs stay for MinJobAge; no sacct here)."""
        text = self.run("scontrol", "show", "job", "-o", job_id).stdout
        fields = {}
        # Values may hold spaces (JobName, paths): split before each ` Key=`.
        for part in re.split(r" (?=[A-Za-z:/]+=)", text.strip()):
            key, _, value = part.partition("=")
            fields[key] = value
        return fields

    def wait_for_end(self, job_id: str, timeout: float = 240) -> dict[str, str]:
        deadline = time.time() + timeout
        while time.time() < deadline:
            info = self.job(job_id)
            if info["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                return info
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} still {self.job(job_id)['JobState']} after {timeout} s")


def missing_tools() -> list[str]:
    return [t for t in TOOLS if shutil.which(t) is None]


@pytest.fixture(scope="module")
def slurm_cluster():
    missing = missing_tools()
    if missing:
        pytest.skip(
            f"Slurm is not installed ({', '.join(missing)} missing): "
            "apt-get install -y --no-install-recommends slurm-wlm munge (.ci/run does)"
        )
    folder = Path(tempfile.mkdtemp(dir="/tmp", prefix="launcher-slurm-"))
    log = open(folder.parent / f"{folder.name}.log", "w")
    proc = subprocess.Popen(["bash", str(SCRIPT), str(folder)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 90
        while not (folder / "ready").exists():
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the local Slurm did not start:\n{Path(log.name).read_text()[-3000:]}")
            time.sleep(0.2)
        daemons = [int(p) for p in (folder / "pids").read_text().split()]
        yield Cluster(folder, {**os.environ, "SLURM_CONF": str(folder / "slurm.conf")})
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        finally:
            log.close()
    # The script stopped exactly the daemons it started.
    for pid in daemons:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in _state(pid), f"daemon {pid} still running"
    shutil.rmtree(folder, ignore_errors=True)
    Path(log.name).unlink(missing_ok=True)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].splitlines()[0].lower()
    except (OSError, IndexError):
        return "zombie"

"""Two "pods" of a rendered Kubernetes Job, started here as local processes with what
Kubernetes would give them: the container's command and environment from RUN_DIR/job.yaml
(with Kubernetes' $$ unescaped), JOB_COMPLETION_INDEX, a hostname of their own (a UTS
namespace) and an /etc/hosts where the Service's pod names resolve to this machine (a
mount namespace, as the kubelet writes a pod's). They rendezvous through pod 0's DNS name
and train; a SIGKILL of one pod ends the other's torchrun, and the restarted pods (as
restartPolicy OnFailure restarts them) resume from the shared run directory's latest
checkpoint."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from runs import launch, read_metrics

pytestmark = pytest.mark.slow


def namespaces_allowed() -> bool:
    """Private mount, UTS and PID namespaces (root, or a user namespace-capable kernel)."""
    probe = subprocess.run(
        ["unshare", "--mount", "--uts", "--pid", "--fork", "--kill-child", "true"], capture_output=True
    )
    return probe.returncode == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pods(run: Path) -> tuple[str, list[str], dict[str, str]]:
    """The Job's name, its container's command and environment, as the kubelet would run them."""
    service, job = yaml.safe_load_all((run / "job.yaml").read_text())
    assert service["metadata"]["name"] == job["metadata"]["name"] == job["spec"]["template"]["spec"]["subdomain"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"].replace("$$", "$") for e in container["env"]}
    return job["metadata"]["name"], [a.replace("$$", "$") for a in container["command"]], env


def start_pod(
    name: str, index: int, command: list[str], env: dict[str, str], hosts: Path, log: Path
) -> subprocess.Popen:
    setup = f"mount --bind {hosts} /etc/hosts && hostname {name}-{index} && exec {shlex.join(command)}"
    # A PID namespace too, as a container has: when the pod is killed (unshare, which then
    # kills the namespace's first process), every process in it goes, the ranks included.
    return subprocess.Popen(
        ["unshare", "--mount", "--uts", "--pid", "--fork", "--kill-child", "bash", "-c", setup],
        stdout=open(log, "a"),
        stderr=subprocess.STDOUT,
        env={
            "PATH": os.environ["PATH"],
            "HOME": os.environ.get("HOME", "/root"),
            **env,
            "JOB_COMPLETION_INDEX": str(index),
        },
    )


def wait_steps(run: Path, step: int, procs, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        path = run / "metrics.jsonl"
        if path.exists() and len(path.read_text().splitlines()) >= step:
            return
        assert all(p.poll() is None for p in procs), [p.returncode for p in procs]
        time.sleep(0.2)
    raise AssertionError(f"no step {step} within {timeout} s")


@pytest.mark.skipif(not namespaces_allowed(), reason="needs private mount, UTS and PID namespaces (root): unshare")
def test_two_pods_rendezvous_by_dns_train_and_a_killed_pod_resumes(tmp_path):
    shared = tmp_path / "shared"
    run = shared / "runs" / "a"
    port = free_port()
    proc = launch(
        "cluster=k8s",
        "cluster.nnodes=2",
        "cluster.nproc_per_node=1",
        f"cluster.master_port={port}",
        "cluster.k8s.image=local/train:1",
        f"cluster.k8s.python={sys.executable}",
        "cluster.k8s.volume_claim=shared-runs",
        f"cluster.k8s.mount_path={shared}",
        "train.steps=20",
        "optim.warmup_steps=2",
        "checkpoint.every=5",
        "logger=none",
        "logger.log_every=1",
        run_dir=run,
        command="submit",
    )
    assert f"apply it with: kubectl apply -f {run / 'job.yaml'}" in proc.stdout, proc.stdout
    name, command, env = pods(run)
    assert env["PYTHONPATH"] == str(run / "code") and '--node-rank="$JOB_COMPLETION_INDEX"' in command[2]
    hosts = tmp_path / "hosts"
    # Each pod its own address, as on a cluster (all of 127/8 is this machine's loopback):
    # torchrun tells the nodes apart by the name their address reverses to.
    hosts.write_text(
        "127.0.0.1 localhost\n" + "".join(f"127.0.0.{2 + i} {name}-{i}.{name} {name}-{i}\n" for i in (0, 1))
    )
    logs = [tmp_path / f"pod{i}.log" for i in (0, 1)]

    first = [start_pod(name, i, command, env, hosts, logs[i]) for i in (0, 1)]
    wait_steps(run, 8, first)  # past the step-5 checkpoint
    os.kill(first[1].pid, signal.SIGKILL)  # pod 1 dies with its node's ranks
    assert first[0].wait(timeout=240) != 0, "pod 0's torchrun outlived its peer"
    first[1].wait(timeout=60)

    again = [start_pod(name, i, command, env, hosts, logs[i]) for i in (0, 1)]  # restartPolicy: OnFailure
    for p in again:
        assert p.wait(timeout=300) == 0, "\n".join(log.read_text()[-3000:] for log in logs)
    out = logs[0].read_text()
    assert "resumed from" in out and str(run / "checkpoints") in out, out[-3000:]
    rows = read_metrics(run)
    assert rows[-1]["step"] == 20
    # Each start of the ranks recorded its hosts, the pods' own names, and the code they
    # imported: the copy made at submit.
    starts = [json.loads(line) for line in (run / "provenance" / "hosts.jsonl").read_text().splitlines()]
    assert len(starts) == 2, starts
    assert all(sorted(s["hosts"]) == [f"{name}-0", f"{name}-1"] and s["code"] == str(run / "code") for s in starts)

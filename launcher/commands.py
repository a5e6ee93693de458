"""Pure command builders: config in, argv or script text out. Nothing here touches the
machine, so golden tests cover every shape without launching anything, and `--dry-run`
prints exactly what would run."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from launcher.config import Config, Runner


@dataclass(frozen=True)
class LaunchPlan:
    """What the launch side decided about this machine (impure facts, gathered once)."""

    python: str
    """The interpreter the ranks run (the launcher's own)."""
    nproc_per_node: int
    master_port: int
    threads_per_rank: int
    workdir: str
    """Where the ranks start (the repository, so relative data paths still resolve)."""


def torchrun_argv(cfg: Config, run_dir: str, plan: LaunchPlan) -> list[str]:
    """`python -m torch.distributed.run ... -m launcher.train RUN_DIR`.

    One node: a c10d rendezvous on 127.0.0.1 at a free port (the agent hosts the store).
    Several nodes: the same rendezvous at the first node's address; every agent waits
    `dist.timeout_s` for the others to join.
    """
    c = cfg.cluster
    addr = c.master_addr if c.nnodes > 1 else "127.0.0.1"
    argv = [
        plan.python, "-m", "torch.distributed.run",
        f"--nnodes={c.nnodes}",
        f"--nproc-per-node={plan.nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={addr}:{plan.master_port}",
        f"--rdzv-id={rendezvous_id(run_dir)}",
        f"--rdzv-conf=join_timeout={cfg.dist.timeout_s}",
        f"--max-restarts={c.max_restarts}",
        # Forward SIGUSR1 too (Slurm's warning signal); give ranks time to save.
        "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        f"--shutdown-timeout={c.shutdown_timeout_s}",
    ]
    return argv + ["-m", "launcher.train", run_dir]


def deepspeed_argv(cfg: Config, run_dir: str, plan: LaunchPlan) -> list[str]:
    """The `deepspeed` command (DeepSpeed's launcher, `python -m deepspeed.launcher.runner`, which
    is what the `deepspeed` script runs, with this interpreter).

    One node: `--num_gpus` processes on localhost. Several nodes: the first node reads
    RUN_DIR/hostfile (`hostfile_text`) and starts every node over pdsh/ssh; launch once.
    `--no_local_rank`: ranks read LOCAL_RANK from the environment (launcher.train takes
    only the run directory).
    """
    c = cfg.cluster
    argv = [plan.python, "-m", "deepspeed.launcher.runner", f"--num_nodes={c.nnodes}",
            f"--num_gpus={plan.nproc_per_node}", f"--master_port={plan.master_port}"]
    if c.nnodes > 1:
        argv += [f"--hostfile={run_dir}/{HOSTFILE}", f"--master_addr={c.hosts[0]}", "--launcher=pdsh"]
    argv += ["--no_local_rank", "--log_level=warning", "--module", "launcher.train", run_dir]
    return argv


HOSTFILE = "hostfile"


def hostfile_text(cfg: Config, plan: LaunchPlan) -> str:
    """RUN_DIR/hostfile for runner=deepspeed on several nodes: `host slots=N` per node."""
    return "".join(f"{host} slots={plan.nproc_per_node}\n" for host in cfg.cluster.hosts)


def launch_argv(cfg: Config, run_dir: str, plan: LaunchPlan) -> list[str]:
    """The command of `cluster.runner`."""
    if cfg.cluster.runner == Runner.deepspeed:
        return deepspeed_argv(cfg, run_dir, plan)
    return torchrun_argv(cfg, run_dir, plan)


def rendezvous_id(run_dir: str) -> str:
    """Stable per run directory, so agents of one job (and only they) meet."""
    import hashlib

    return "run-" + hashlib.sha1(run_dir.encode()).hexdigest()[:12]


def rank_env(plan: LaunchPlan) -> dict[str, str]:
    """Environment the launch side sets for the ranks (never secrets)."""
    return {"OMP_NUM_THREADS": str(plan.threads_per_rank)}


def command_script(argv: list[str], env: dict[str, str], workdir: str, run_dir: str) -> str:
    """RUN_DIR/command.sh: the exact command. Running it again resumes the run."""
    lines = [
        "#!/usr/bin/env bash",
        f"# The exact command that trains {shlex.quote(run_dir)}.",
        "# Run it again to resume from the latest checkpoint (checkpoint.resume=auto).",
        "set -euo pipefail",
        f"cd {shlex.quote(workdir)}",
    ]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())]
    lines.append("exec " + " ".join(shlex.quote(a) for a in argv))
    return "\n".join(lines) + "\n"

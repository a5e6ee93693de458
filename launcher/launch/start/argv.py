"""Pure command builders: config in, argv or script text out. Nothing here touches the
machine, so golden tests cover every shape without launching anything, and `--dry-run`
prints exactly what would run."""

from __future__ import annotations

import functools
import hashlib
import re
import shlex
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, distribution, version
from pathlib import Path

import yaml

from launcher.config import Config, Runner
from launcher.exits import COMM_TRACE


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
    code: str | None = None
    """A Slurm job's copy of the project's code (RUN_DIR/code, cluster.snapshot_code): the
    job imports it first (PYTHONPATH; PYTHONSAFEPATH keeps the working directory's out)."""


class ShellExpr(str):
    """Shell text placed unquoted, evaluated where the command runs (a Slurm task's
    "$SLURM_NODEID"). Only this module makes them, from constants: never from config values."""


def shell_word(arg: str) -> str:
    return str(arg) if isinstance(arg, ShellExpr) else shlex.quote(arg)


@dataclass(frozen=True)
class NodeArgs:
    """Who this node is: known on the launch side (by hand), or shell text a Slurm task
    evaluates on its node."""

    nnodes: str
    node_rank: str | None
    """None: a single node (torchrun's default, node 0)."""
    endpoint: str
    """host:port of the c10d rendezvous."""


def node_args(cfg: Config, plan: LaunchPlan) -> NodeArgs:
    c = cfg.cluster
    if c.nnodes == 1:
        return NodeArgs("1", None, f"127.0.0.1:{plan.master_port}")
    return NodeArgs(str(c.nnodes), str(c.node_rank), f"{c.master_addr}:{plan.master_port}")


def join_timeout(cfg: Config) -> int:
    return cfg.cluster.join_timeout_s or cfg.dist.timeout_s


def _option(name: str, value: str) -> str:
    text = f"--{name}={value}"
    return ShellExpr(text) if isinstance(value, ShellExpr) else text


def torchrun_argv(cfg: Config, run_dir: str, plan: LaunchPlan, node: NodeArgs | None = None) -> list[str]:
    """`python -m torch.distributed.run ... -m launcher.rank RUN_DIR`.

    One node: a c10d rendezvous on 127.0.0.1 at a free port (the agent hosts the store).
    Several nodes: the same rendezvous at the first node's address, and this node's rank;
    every agent waits `cluster.join_timeout_s` for the others to join. c10d numbers the
    ranks itself (sorted by host), which is harmless: every rank of a job reads the same
    config and checkpoints are per global rank.
    """
    c = cfg.cluster
    node = node or node_args(cfg, plan)
    argv = [
        plan.python,
        "-m",
        "torch.distributed.run",
        _option("nnodes", node.nnodes),
        *([_option("node-rank", node.node_rank)] if node.node_rank is not None else []),
        f"--nproc-per-node={plan.nproc_per_node}",
        "--rdzv-backend=c10d",
        _option("rdzv-endpoint", node.endpoint),
        f"--rdzv-id={rendezvous_id(run_dir)}",
        f"--rdzv-conf=join_timeout={join_timeout(cfg)}",
        f"--max-restarts={c.max_restarts}",
        # Forward SIGUSR1 too (Slurm's warning signal); give ranks time to save.
        f"--signals-to-handle={SIGNALS}",
        # torchrun before torch 2.13 has no such option: the ranks get its fixed 30 s.
        *([f"--shutdown-timeout={c.shutdown_timeout_s}"] if torchrun_takes("--shutdown-timeout") else []),
    ]
    if c.local_addr:
        argv.append(f"--local-addr={c.local_addr}")
    return argv + ["-m", "launcher.rank", run_dir]


SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
"""The signals torchrun passes on to its ranks."""


@functools.cache
def torchrun_takes(option: str) -> bool:
    """Whether the installed torch's torchrun takes `option`, read from its source (a site's
    older torch, TORCH=system, lacks the newer options), without importing torch."""
    try:
        return f'"{option}"' in Path(str(distribution("torch").locate_file("torch/distributed/run.py"))).read_text()
    except (PackageNotFoundError, OSError):
        return True


def deepspeed_argv(cfg: Config, run_dir: str, plan: LaunchPlan) -> list[str]:
    """The `deepspeed` command (DeepSpeed's launcher, `python -m deepspeed.launcher.runner`, which
    is what the `deepspeed` script runs, with this interpreter).

    One node: `--num_gpus` processes on localhost. Several nodes: the first node reads
    RUN_DIR/hostfile (`hostfile_text`) and starts every node over pdsh/ssh; launch once.
    `--no_local_rank`: ranks read LOCAL_RANK from the environment (launcher.rank.entry takes
    only the run directory).
    """
    c = cfg.cluster
    argv = [
        plan.python,
        "-m",
        "deepspeed.launcher.runner",
        f"--num_nodes={c.nnodes}",
        f"--num_gpus={plan.nproc_per_node}",
        f"--master_port={plan.master_port}",
    ]
    if c.nnodes > 1:
        argv += [f"--hostfile={run_dir}/{HOSTFILE}", f"--master_addr={c.hosts[0]}", "--launcher=pdsh"]
    argv += ["--no_local_rank", "--log_level=warning", "--module", "launcher.rank", run_dir]
    return argv


HOSTFILE = "hostfile"


def hostfile_text(cfg: Config, plan: LaunchPlan) -> str:
    """RUN_DIR/hostfile for runner=deepspeed on several nodes: `host slots=N` per node."""
    return "".join(f"{host} slots={plan.nproc_per_node}\n" for host in cfg.cluster.hosts)


ACCELERATE_CONFIG = "accelerate_config.yaml"


def accelerate_argv(cfg: Config, run_dir: str, plan: LaunchPlan) -> list[str]:
    """`accelerate launch` (`python -m accelerate.commands.launch`, what the `accelerate`
    script's launch runs, with this interpreter) of RUN_DIR/accelerate_config.yaml, never
    accelerate's default config in ~/.cache: the run directory alone reproduces the launch.
    The config's MULTI_GPU is torchrun underneath (torch.distributed.run in accelerate's own
    process, which stays our child; gloo ranks on CPU too). accelerate's own defaults win over
    both its config file and torchrun's environment for rdzv_backend, rdzv_conf and
    max_restarts: they are flags here; torchrun's other options come from accelerate_env."""
    return [
        plan.python,
        "-m",
        "accelerate.commands.launch",
        f"--config_file={run_dir}/{ACCELERATE_CONFIG}",
        "--rdzv_backend=c10d",
        f"--rdzv_conf=join_timeout={join_timeout(cfg)}",
        f"--max_restarts={cfg.cluster.max_restarts}",
        "--module",
        "launcher.rank",
        run_dir,
    ]


def accelerate_config_text(cfg: Config, plan: LaunchPlan) -> str:
    """RUN_DIR/accelerate_config.yaml: one machine, nproc_per_node processes under torchrun
    (MULTI_GPU; accelerate's MULTI_CPU would start them with mpirun), its rendezvous at
    127.0.0.1:master_port. Precision, compilation and devices stay the ranks' own (no mixed
    precision, no dynamo, every GPU visible): accelerate only starts the ranks, which never
    build its Accelerator."""
    values = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "MULTI_GPU",
        "num_machines": 1,
        "machine_rank": 0,
        "num_processes": plan.nproc_per_node,
        "main_process_ip": "127.0.0.1",
        "main_process_port": plan.master_port,
        "rdzv_backend": "c10d",
        "same_network": False,
        "gpu_ids": "all",
        "mixed_precision": "no",
        "use_cpu": False,
        "debug": False,
        "downcast_bf16": False,
        "enable_cpu_affinity": False,
        "dynamo_config": {},
    }
    return (
        "# This run's accelerate config (cluster.runner=accelerate): command.sh runs `accelerate launch\n"
        "# --config_file` on it; torchrun's other options are that command's flags and PET_* variables\n"
        "# (accelerate takes rdzv_backend from its flag, not from here).\n" + yaml.safe_dump(values, sort_keys=False)
    )


def accelerate_env(cfg: Config, run_dir: str, plan: LaunchPlan) -> dict[str, str]:
    """torchrun's options that accelerate has no flag for, as torchrun reads them from the
    environment (PET_<OPTION>, in accelerate's process where torchrun parses them): the c10d
    endpoint and id, the signals it passes on (SIGUSR1 too), the ranks' time to save."""
    c = cfg.cluster
    env = {
        "PET_RDZV_ENDPOINT": node_args(cfg, plan).endpoint,
        "PET_RDZV_ID": rendezvous_id(run_dir),
        "PET_SIGNALS_TO_HANDLE": SIGNALS,
    }
    if torchrun_takes("--shutdown-timeout"):
        env["PET_SHUTDOWN_TIMEOUT"] = str(c.shutdown_timeout_s)
    if c.local_addr:
        env["PET_LOCAL_ADDR"] = c.local_addr
    return env


def launch_argv(cfg: Config, run_dir: str, plan: LaunchPlan) -> list[str]:
    """The command of `cluster.runner`."""
    if cfg.cluster.runner == Runner.deepspeed:
        return deepspeed_argv(cfg, run_dir, plan)
    if cfg.cluster.runner == Runner.accelerate:
        return accelerate_argv(cfg, run_dir, plan)
    return torchrun_argv(cfg, run_dir, plan)


def launch_env(cfg: Config, plan: LaunchPlan, run_dir: str) -> dict[str, str]:
    """command.sh's environment: the ranks' (rank_env), and the runner's own options where it
    reads them from there (accelerate's torchrun)."""
    runner = accelerate_env(cfg, run_dir, plan) if cfg.cluster.runner == Runner.accelerate else {}
    return {**runner, **rank_env(cfg, plan, run_dir)}


def rendezvous_id(run_dir: str) -> str:
    """Stable per run directory, so agents of one job (and only they) meet."""
    return "run-" + hashlib.sha1(run_dir.encode()).hexdigest()[:12]


def rank_env(cfg: Config, plan: LaunchPlan, run_dir: str) -> dict[str, str]:
    """Environment the launch side sets for the ranks (never secrets): threads, the
    collectives' flight recorder, then the config's cluster.env (network settings), which wins."""
    return {"OMP_NUM_THREADS": str(plan.threads_per_rank), **comm_env(cfg, run_dir), **cfg.cluster.env}


def job_env(cfg: Config, plan: LaunchPlan, run_dir: str) -> dict[str, str]:
    """A scheduled job's rank environment (Slurm, Kubernetes): rank_env, unbuffered output,
    and with a code copy (plan.code) the copy first on PYTHONPATH, the working directory out."""
    env = {**rank_env(cfg, plan, run_dir), "PYTHONUNBUFFERED": "1"}
    if plan.code is not None:
        env |= {"PYTHONPATH": ":".join(p for p in (plan.code, env.get("PYTHONPATH")) if p), "PYTHONSAFEPATH": "1"}
    return env


def comm_env(cfg: Config, run_dir: str, torch_version: str | None = None) -> dict[str, str]:
    """torch's flight recorder (read by NCCL and gloo alike) keeps each rank's last
    dist.flight_recorder collectives. The hang watchdog compares their counts and writes the
    record (launcher/rank/watchdog.py); NCCL's own timeout, the backstop, dumps it too
    (DUMP_ON_TIMEOUT, into the same folder and format). Async error handling 3 (skip clean-up:
    torch's default, set so a site's 1 does not lose the dump, pytorch#121055) ends the process
    on a timed-out collective without aborting communicators other ranks still use."""
    n = cfg.dist.flight_recorder
    size, dump_file = flight_recorder_names(torch_version or installed_torch())
    env = {size: str(n), "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    if n:
        env |= {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1", dump_file: f"{run_dir}/{COMM_TRACE}/rank_"}
    return env


def flight_recorder_names(torch_version: str) -> tuple[str, str]:
    """The recorder's size and dump-file variables for that torch: TORCH_FR_BUFFER_SIZE and
    TORCH_FR_DUMP_TEMP_FILE from 2.11 (the release the recorder was first read under these
    names that we checked; from then on every process warns on stderr when it meets the old
    names), TORCH_NCCL_TRACE_BUFFER_SIZE and TORCH_NCCL_DEBUG_INFO_TEMP_FILE before it."""
    release = tuple(int(p) for p in re.findall(r"\d+", torch_version)[:2])
    if release >= (2, 11):
        return "TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE"
    return "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"


def installed_torch() -> str:
    """The torch the ranks will import (the launch side's own environment), without importing it."""
    return version("torch")


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
    lines += [
        "# A launch still running there: say so now (its rendezvous would keep this one waiting).",
        f"{shell_word(argv[0])} -m launcher.runlock {shlex.quote(run_dir)}",
        "# Supervised as `launcher train` supervises it: a Ctrl-C saves and exits 130 in one line.",
        f"exec {shell_word(argv[0])} -m launcher.launch.start.supervise {shlex.quote(run_dir)} "
        + " ".join(shell_word(a) for a in argv),
    ]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- Slurm
SBATCH_TEMPLATE = Path(__file__).resolve().parents[3] / "scripts" / "slurm" / "job.sbatch"
_SBATCH_PLAIN = re.compile(r"[\w.,:+=@/%\[\]-]+")


def sbatch_quote(value: str) -> str:
    """A value in an `#SBATCH` line. sbatch reads those lines itself, not through a shell:
    it honours double quotes and backslash escapes (single quotes would become part of the
    value). Line breaks are refused before this point."""
    if _SBATCH_PLAIN.fullmatch(value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def job_name(cfg: Config, run_dir: str) -> str:
    """cluster.run_name, else the run directory's last two parts (a sweep point is `<sweep>-<i>`)."""
    return cfg.run_name or "-".join(Path(run_dir).parts[-2:])


def sbatch_options(cfg: Config, run_dir: str) -> list[str]:
    """The #SBATCH lines from the config; cluster.sbatch_extra last (the template puts these
    after its own), so they win."""
    c = cfg.cluster
    opts = [("job-name", job_name(cfg, run_dir)), ("nodes", str(c.nnodes)), ("ntasks-per-node", "1")]
    for key in ("partition", "account", "qos", "time"):
        if getattr(c, key) is not None:
            opts.append((key, getattr(c, key)))
    if c.gpus_per_node:
        opts.append(("gpus-per-node", str(c.gpus_per_node)))
    if c.cpus_per_task is not None:
        opts.append(("cpus-per-task", str(c.cpus_per_task)))
    if c.mem is not None:
        opts.append(("mem", c.mem))
    if c.constraint is not None:
        opts.append(("constraint", c.constraint))
    lines = [f"#SBATCH --{key}={sbatch_quote(value)}" for key, value in opts]
    if c.exclusive:
        lines.append("#SBATCH --exclusive")
    return lines + [f"#SBATCH {line}" for line in c.sbatch_extra]


def _continued(words: list[str], indent: str) -> str:
    """Words on lines: a new line before each option, so a long command stays readable."""
    out = words[0]
    for word in words[1:]:
        out += f" \\\n{indent}{word}" if word.startswith("-") else f" {word}"
    return out


def torchrun_step(cfg: Config, run_dir: str, plan: LaunchPlan) -> str:
    """The job step: one srun task per node, each starting torchrun for its node. The
    node's count, rank and the first node's name are evaluated by the task (bash -c);
    everything else is quoted twice: once for that bash, once for the batch shell."""
    node = NodeArgs(ShellExpr('"$SLURM_NNODES"'), ShellExpr('"$SLURM_NODEID"'), ShellExpr('"$HEAD_NODE:$MASTER_PORT"'))
    inner = "exec " + _continued([shell_word(a) for a in torchrun_argv(cfg, run_dir, plan, node)], "    ")
    # --wait: once one node's task has ended, the others get 60 s to finish (a preempted
    # rank 0 still closes W&B) before srun stops them (a crashed node does not hang the job).
    srun = ["srun", "--ntasks-per-node=1", "--wait=60"]
    if cfg.cluster.cpus_per_task is not None:  # since Slurm 22.05 srun no longer inherits it
        srun.append(f"--cpus-per-task={cfg.cluster.cpus_per_task}")
    return " ".join(srun) + " bash -c " + shlex.quote(inner)


# cluster.runner -> the command of the job step. A runner joins Slurm by adding its branch
# here (the deepspeed runner: its launcher per node, or a hostfile from SLURM_JOB_NODELIST).
SLURM_STEPS = {Runner.torchrun: torchrun_step}


def render(template: str, values: dict[str, str]) -> str:
    """Fill {{name}} placeholders; every placeholder must have a value and every value a place."""
    used = set(re.findall(r"\{\{(\w+)\}\}", template))
    if used != set(values):
        raise KeyError(f"template placeholders {sorted(used)} != values {sorted(values)}")
    return re.sub(r"\{\{(\w+)\}\}", lambda m: values[m.group(1)], template)


def sbatch_script(cfg: Config, run_dir: str, plan: LaunchPlan, template: str | None = None) -> str:
    """RUN_DIR/job.sbatch from scripts/slurm/job.sbatch. Values in #SBATCH lines are
    sbatch-quoted, values in shell lines shlex-quoted; cluster.setup lines are shell code
    the user wrote and go in as they are."""
    c = cfg.cluster
    env = job_env(cfg, plan, run_dir)
    port = str(c.master_port) if c.master_port is not None else "$((20000 + SLURM_JOB_ID % 20000))"
    values = {
        "title": f"Slurm job for the run directory {shlex.quote(run_dir)}",
        "run_dir": shlex.quote(run_dir),
        "sbatch_lines": "\n".join(sbatch_options(cfg, run_dir)),
        "grace": str(c.preempt_grace_s),
        "requeue": "--requeue" if c.requeue else "--no-requeue",
        "requeue_on_preempt": "true" if c.requeue else "false",
        "max_requeues": str(c.max_requeues),
        "max_restarts": str(c.max_restarts),
        "setup": "\n".join(c.setup) if c.setup else "# (none)",
        "workdir": shlex.quote(plan.workdir),
        "exports": "\n".join(f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())),
        "master_port": port,
        "step": SLURM_STEPS[c.runner](cfg, run_dir, plan),
    }
    return render(template if template is not None else SBATCH_TEMPLATE.read_text(), values)

"""Launch side: `launcher train [overrides...] [--dry-run] [-m]`.

One process that never touches a GPU: compose the Hydra config once, validate it, make
the run directory (config.yaml, command.sh), then exec torchrun. Bad input ends here
with one line on stderr and exit code 2, before any rank starts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException, MissingConfigException
from omegaconf import OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from launcher import config as C
from launcher import fit, identity, offline, plaintext, runlock, slurm
from launcher.checkpoint import lock_folders, root_of
from launcher.commands import (HOSTFILE, SLURM_STEPS, LaunchPlan, command_script, hostfile_text, launch_argv, rank_env,
                               sbatch_script)
from launcher.device import HostInfo
from launcher.exits import EXIT_INTERRUPTED
from launcher.preempt import supervise
from launcher.validate import validate

REPO = Path(__file__).resolve().parent.parent
CONF_DIR = REPO / "conf"
COMMANDS = ("train", "export", "plan", "submit")
USAGE = """usage: launcher train [key=value ...] [--dry-run] [-m|--multirun]
       launcher plan [key=value ...] [--json]
       launcher submit [key=value ...] [--dry-run] [-m|--multirun]   (a Slurm batch job; cluster=slurm)
       launcher export RUN_DIR [export.key=value ...]"""


class UsageError(Exception):
    """Bad input that is not about one config key."""


# ----------------------------------------------------------------------------- compose
def compose_config(overrides: list[str]) -> tuple[C.Config, Path, dict]:
    """Compose conf/ with the overrides; return the typed config, the run directory
    Hydra resolved (hydra.run.dir, ${now:} evaluated once, here) and Hydra's node."""
    C.register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        node = compose("config", overrides=overrides, return_hydra_config=True)
    hydra_node = node.hydra
    run_dir = Path(str(hydra_node.run.dir))
    with open_dict(node):
        del node["hydra"]
    return C.to_typed(node), run_dir, hydra_node


def expand_sweep(overrides: list[str]) -> list[list[str]]:
    """Hydra's sweep syntax (`optim.lr=1e-3,3e-3`) -> one override list per point."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    batches = BasicSweeper.split_arguments(parsed, max_batch_size=None)
    return [list(point) for batch in batches for point in batch]


# ----------------------------------------------------------------------------- errors
def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def describe(e: BaseException) -> str:
    """One line for a composition or validation error: key, value, what is allowed."""
    if isinstance(e, C.ConfigError):
        return str(e)
    if isinstance(e, MissingConfigException):
        text = str(e)
        for group in C.GROUPS:
            if f"'{group}/" in text:
                name = text.split(f"'{group}/", 1)[1].split("'", 1)[0]
                allowed = _options(group) + (["auto (the planner chooses)"] if group == "recipe" else [])
                return f"{group}={name}: no such {group}; allowed: {', '.join(allowed)}"
        return text.splitlines()[0]
    # The OmegaConf error in the chain that names a key carries the reason.
    chain, inner = [], e
    while inner is not None and inner not in chain:
        chain.append(inner)
        inner = inner.__cause__ or inner.__context__
    for err in chain:
        if isinstance(err, OmegaConfBaseException) and getattr(err, "full_key", None):
            return _describe_omegaconf(err)
    text = str(e).strip()
    return text.splitlines()[0] if text else e.__class__.__name__


def _describe_omegaconf(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None) or "?"
    msg = str(getattr(e, "msg", "") or e).strip().splitlines()[0]
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, MissingMandatoryValue, ValidationError

    if isinstance(e, (ConfigKeyError, ConfigAttributeError)) and "not in" in msg:
        parent, _, leaf = key.rpartition(".")
        schema = C.GROUPS.get(parent.split(".")[0]) if parent else C.Config
        allowed = ""
        if schema is not None:
            node = OmegaConf.structured(schema)
            for part in parent.split(".")[1:]:
                node = node[part]
            allowed = "; allowed keys: " + ", ".join(node.keys())
        return f"{key}: unknown key{allowed}"
    if isinstance(e, MissingMandatoryValue):
        return f"{key}: missing; it must be given (e.g. {key}=...)"
    if isinstance(e, ValidationError):
        value = getattr(e, "value", None)
        if "expected one of" in msg:
            allowed = msg.split("expected one of", 1)[1].strip()
            return f"{key}={value}: not allowed; allowed: {allowed.strip('[]')}"
        want = "the declared type"
        if "converted to" in msg:
            want = msg.split("converted to", 1)[1].strip()
        elif "is not a valid" in msg:
            want = msg.split("is not a valid", 1)[1].split()[0].capitalize().replace("Bool", "Boolean")
        names = {"Integer": "int", "Float": "float", "Boolean": "bool (true/false)", "String": "str"}
        return f"{key}={value}: wrong type; expected {names.get(want, want)}"
    return f"{key}: {msg}"


# ----------------------------------------------------------------------------- run dir
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_plan(cfg: C.Config, host: HostInfo) -> LaunchPlan:
    nproc = C.nproc_per_node(cfg, host)
    threads = cfg.cluster.cpu_threads or max(1, host.cpus // nproc)
    port = cfg.cluster.master_port or free_port()
    return LaunchPlan(python=sys.executable, nproc_per_node=nproc, master_port=port, threads_per_rank=threads,
                      workdir=os.getcwd())


def writable_parent(path: Path, key: str) -> Path:
    """The nearest existing folder at or above `path`, proven writable by creating (and
    removing) a file in it: permission bits alone do not tell (root, read-only mounts,
    /proc). Found here, on the launch side, not on a rank."""
    probe = path
    while not probe.exists():
        probe = probe.parent
    try:
        if not probe.is_dir():
            raise NotADirectoryError(20, "not a folder")
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".launcher-probe-"):
            pass
    except OSError as err:
        raise C.ConfigError(key, str(path), f"cannot write under {probe} ({err.strerror}); choose a writable folder")
    return probe


def check_writable(run_dir: Path) -> None:
    writable_parent(run_dir, "hydra.run.dir")


def checkpoint_bound(cfg: C.Config) -> int:
    """Upper bound of one checkpoint's bytes: fp32 weights, Adam's two moments and a
    low-precision copy, 16 bytes for each parameter of the model as it will be built
    (its meta-device build: model=hf counts the Hugging Face model itself)."""
    from launcher import models

    return 16 * sum(p.numel() for p in models.on_meta(cfg).parameters())


def check_checkpoint_space(cfg: C.Config, run_dir: Path) -> None:
    """The checkpoint folder is writable and its disk has room for keep + 1 checkpoints
    (the newest is written before the oldest is deleted), found here, not mid-run."""
    from launcher.checkpoint import complete_checkpoints

    root = root_of(cfg, run_dir)
    probe = writable_parent(root, "checkpoint.dir")
    each = checkpoint_bound(cfg)
    existing = sum(f.stat().st_size for d in complete_checkpoints(root) for f in d.rglob("*") if f.is_file())
    need = max(each, each * (cfg.checkpoint.keep + 1) - existing)
    free = shutil.disk_usage(probe).free
    if free < need:
        raise C.ConfigError("checkpoint.dir", str(root),
                            f"{free / 2**30:.2f} GiB free, but keep={cfg.checkpoint.keep} checkpoints of up to "
                            f"{each / 2**30:.2f} GiB need {need / 2**30:.2f} GiB; free space, lower checkpoint.keep, "
                            f"or choose another checkpoint.dir")


def check_resume_is_data(cfg: C.Config, run_dir: Path) -> None:
    """Every checkpoint the ranks may resume from can be read without running code
    (launcher/untrusted.py): a crafted file is refused here, in one line, before any rank
    starts. Only pickles' small parts are read (no digests, no tensor data)."""
    from launcher.checkpoint import resumable
    from launcher.untrusted import check_checkpoint

    for folder in resumable(cfg, run_dir):
        problem = check_checkpoint(folder)
        if problem:
            raise C.ConfigError("checkpoint.resume", cfg.checkpoint.resume, problem)


def run_files(cfg: C.Config, plan: LaunchPlan, ds: dict | None) -> dict[str, str]:
    """Files besides config.yaml the ranks or the runner read: ds_config.json (ZeRO), the
    hostfile (runner=deepspeed on several nodes)."""
    from launcher import ds_config

    files = {}
    if ds is not None:
        files[ds_config.FILE] = ds_config.text(ds)
    if cfg.cluster.runner == C.Runner.deepspeed and cfg.cluster.nnodes > 1:
        files[HOSTFILE] = hostfile_text(cfg, plan)
    return files


def prepare_run(cfg: C.Config, run_dir: Path, plan: LaunchPlan,
                files: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """Write RUN_DIR/config.yaml, command.sh and `files`; return the command and its
    environment. A failure here removes a run directory this call created."""
    argv = launch_argv(cfg, str(run_dir), plan)
    env = rank_env(plan, cfg.cluster.env)
    # Several nodes share the run directory: node 0 writes command.sh, node k command.node<k>.sh.
    name = "command.sh" if cfg.cluster.node_rank == 0 else f"command.node{cfg.cluster.node_rank}.sh"
    write_run_dir(cfg, run_dir, {name: command_script(argv, env, plan.workdir, str(run_dir))}, files)
    return argv, env


def write_run_dir(cfg: C.Config, run_dir: Path, scripts: dict[str, str], files: dict[str, str] | None = None) -> bool:
    """RUN_DIR/config.yaml, executable scripts and other files the ranks read. A failure
    removes a run directory this call created. Returns whether it created the directory."""
    created = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.cluster.node_rank == 0:  # every rank of every node reads node 0's (its run id among the rest)
            (run_dir / "config.yaml").write_text(C.to_yaml(cfg))
            for name, text in (files or {}).items():
                (run_dir / name).write_text(text)
        for name, text in scripts.items():
            (run_dir / name).write_text(text)
            (run_dir / name).chmod(0o755)
    except OSError as err:
        if created:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise C.ConfigError("hydra.run.dir", str(run_dir), f"cannot write the run directory ({err.strerror})")
    if cfg.data.name == C.DataKind.hf_text:
        prepare_data(cfg, run_dir, created)
    return created


def prepare_data(cfg: C.Config, run_dir: Path, created: bool) -> None:
    """data=hf_text: tokenize once, here, before any rank starts (the ranks memory-map the
    cache). A failure removes a run directory this launch created."""
    from launcher.hf_text import prepare_cache

    try:
        print(prepare_cache(cfg, run_dir), flush=True)
    except (C.ConfigError, OSError) as err:
        if created:
            shutil.rmtree(run_dir, ignore_errors=True)
        if isinstance(err, OSError):
            raise C.ConfigError("data.files", cfg.data.files, f"the token cache could not be written ({err})")
        raise


# ----------------------------------------------------------------------------- main
class Args(NamedTuple):
    command: str
    overrides: list[str]
    dry_run: bool = False
    multirun: bool = False
    as_json: bool = False


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2 (main), not argparse's usage block
        raise UsageError(f"{self.prog}: {message} (launcher --help)")


def parse_args(argv: list[str]) -> Args:
    """`launcher [COMMAND] [flags] [key=value ...]`; COMMAND defaults to train. Flags are
    flags (never written into config.yaml); everything else is a Hydra override."""
    command = "train"
    if argv and not argv[0].startswith("-") and "=" not in argv[0]:
        command, argv = argv[0], argv[1:]
        if command not in COMMANDS:
            raise UsageError(f"unknown command '{command}'; allowed: {', '.join(COMMANDS)}")
    parser = _Parser(prog=f"launcher {command}", add_help=False)
    parser.add_argument("overrides", nargs="*")
    if command in ("train", "submit"):
        parser.add_argument("--dry-run", action="store_true", help="print the run's files and command; start nothing")
        parser.add_argument("-m", "--multirun", action="store_true", help="a sweep: one run per point")
    if command == "plan":
        parser.add_argument("--json", action="store_true", dest="as_json", help="the table as JSON")
    parsed, unknown = parser.parse_known_intermixed_args(argv)
    if unknown:
        flags = {"train": "--dry-run, -m/--multirun", "submit": "--dry-run, -m/--multirun", "plan": "--json"}
        raise UsageError(f"unknown flag '{unknown[0]}' for {command}; allowed: {flags.get(command, 'none')}, "
                         "or key=value overrides")
    args = Args(command, parsed.overrides, getattr(parsed, "dry_run", False), getattr(parsed, "multirun", False),
                getattr(parsed, "as_json", False))
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for o in args.overrides if command in ("train", "submit") else []:
        try:
            parser.parse_overrides([o])
        except HydraException as e:
            raise UsageError(f"{o}: cannot parse ({str(e).splitlines()[0]}); overrides look like key=value")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    offline()  # nothing is fetched from a model or dataset hub; torchrun and the ranks inherit it
    try:
        args = parse_args(argv)
        if args.command == "export":
            return cmd_export(args.overrides)
        if args.command == "plan":
            return cmd_plan(args.overrides, args.as_json)
        if args.command == "submit":
            return cmd_submit(args.overrides, args.multirun, args.dry_run)
        return cmd_train(args.overrides, args.multirun, args.dry_run)
    except (UsageError, runlock.Held) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (C.ConfigError, HydraException, OmegaConfBaseException, ValueError) as e:
        print(f"error: {describe(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the ranks started (after, supervise handles it)
        print("interrupted (Ctrl-C) before training started", file=sys.stderr)
        return EXIT_INTERRUPTED


def compose_jobs(command: str, overrides: list[str], multirun: bool,
                 dry_run: bool = False) -> list[tuple[C.Config, Path, HostInfo, str | None]]:
    """`train` and `submit` alike: compose and validate every point of a sweep first (bad
    input starts nothing and writes nothing); each point gets its own run directory."""
    here = HostInfo.detect()
    if command == "submit" and not any(o.split("=", 1)[0].lstrip("+~") == "cluster" for o in overrides):
        overrides = ["cluster=slurm", *overrides]
    jobs, sweep_dir = [], None
    for i, point in enumerate(expand_sweep(overrides) if multirun else [overrides]):
        point, choice = resolve_auto(point, planned_host(command, point, here))
        cfg, run_dir, hydra_node = compose_config(point)
        if multirun:  # one sweep folder, resolved once (its ${now:} would move on between points)
            sweep_dir = sweep_dir or Path(str(hydra_node.sweep.dir))
            run_dir = sweep_dir / str(i)
        run_dir = run_dir.resolve()
        check_command(command, cfg, point, multirun)
        # A Slurm job is validated against the nodes it asks for, not this login machine.
        host = slurm.node_host(cfg, here) if command == "submit" else here
        validate(cfg, host)
        plaintext.check(cfg)
        plaintext.check_remote_shell(cfg, run_dir, os.getcwd())
        check_run_dir_name(run_dir)
        check_writable(run_dir)
        check_checkpoint_space(cfg, run_dir)
        check_resume_is_data(cfg, run_dir)
        identity.decide(cfg, run_dir)  # a fresh start into another run's checkpoints: refused here
        fit.check(cfg, run_dir)  # a checkpoint of another shape or format: refused here
        jobs.append((cfg, run_dir, host, choice, zero_config(cfg, host)))
    if command == "submit" and not dry_run:
        slurm.check_client()
    return jobs


def planned_host(command: str, point: list[str], here: HostInfo) -> HostInfo:
    """What recipe=auto / train.micro_batch=auto plan for: this machine, or a Slurm job's nodes."""
    auto = ("recipe=auto", "train.micro_batch=auto")
    if command != "submit" or not any(o in auto for o in point):
        return here
    return slurm.node_host(compose_config([o for o in point if o not in auto])[0], here)


def check_command(command: str, cfg: C.Config, point: list[str], multirun: bool) -> None:
    """The config fits the command: Slurm configs are submitted, others trained here."""
    c = cfg.cluster
    slurm_cfg = c.scheduler == C.Scheduler.slurm
    if command == "train" and slurm_cfg:
        raise C.ConfigError("cluster.scheduler", "slurm", f"cluster={c.name} is a Slurm config: submit it with "
                                                          "`make submit` (launcher submit), or train here with cluster=local")
    if command == "submit":
        if not slurm_cfg:
            raise C.ConfigError("cluster.scheduler", c.scheduler.value,
                                f"cluster={c.name} is not a Slurm config; submit needs one, e.g. cluster=slurm")
        if c.runner not in SLURM_STEPS:
            raise C.ConfigError("cluster.runner", c.runner.value,
                                f"submit supports: {', '.join(r.value for r in SLURM_STEPS)}")
    if command == "train" and c.nnodes > 1 and c.runner != C.Runner.deepspeed:  # deepspeed: one launch for all
        key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
        if not any(o.startswith(key + "=") for o in point):
            raise C.ConfigError(key, "(default: a timestamp)",
                                f"a run over cluster.nnodes={c.nnodes} nodes needs the same {key}=... on every node "
                                "(a folder they share)")
        from launcher.rendezvous import check_master_addr

        check_master_addr(cfg)


def check_run_dir_name(run_dir: Path) -> None:
    """The run directory's path goes into scripts (quoted): a line break would end a comment."""
    if any(ch in str(run_dir) for ch in "\n\r\0"):
        raise C.ConfigError("hydra.run.dir", repr(str(run_dir)), "a path without line breaks")


def cmd_train(overrides: list[str], multirun: bool, dry_run: bool = False) -> int:
    """Compose and validate every point first (bad input starts nothing), then run each."""
    rc = 0
    for cfg, run_dir, host, choice, ds in compose_jobs("train", overrides, multirun):
        plan = make_plan(cfg, host)
        files = run_files(cfg, plan, ds)
        if dry_run:
            print(C.to_yaml(cfg), end="")
            for name, text in files.items():
                print(f"# {name}")
                print(text, end="")
            print("# command")
            print(command_script(launch_argv(cfg, str(run_dir), plan), rank_env(plan, cfg.cluster.env),
                                 plan.workdir, str(run_dir)), end="")
            continue
        if nothing_to_train(cfg, run_dir):
            continue
        created = not run_dir.exists()
        with contextlib.ExitStack() as held:
            owner = cfg.cluster.node_rank == 0  # the other nodes of a launch by hand share node 0's directory
            try:
                if owner:  # the run directory and the checkpoint folder: one writer in each
                    for folder in lock_folders(cfg, run_dir):
                        held.enter_context(runlock.hold(folder))
                    runlock.check_free(run_dir)  # a Slurm job queued for it would start into this run
                rc = max(rc, launch_job(cfg, run_dir, plan, files, choice, overrides))
            except (C.ConfigError, runlock.Held):  # refused before any rank started: leave no trace
                if created and owner:
                    held.close()
                    shutil.rmtree(run_dir, ignore_errors=True)
                raise
    return rc


def launch_job(cfg: C.Config, run_dir: Path, plan: LaunchPlan, files: dict[str, str], choice: str | None,
               overrides: list[str]) -> int:
    """Write the run directory and run the ranks under supervision; the exit code."""
    if cfg.cluster.node_rank == 0:  # the other nodes of a launch by hand run what node 0 settles
        cfg = identity.settle(cfg, run_dir)
    cfg = wandb_reachable_or_offline(cfg, run_dir)
    argv_run, env = prepare_run(cfg, run_dir, plan, files)
    env = {**env, **runlock.for_ranks()}  # rank 0 finds the lock held by its own launch (not in command.sh)
    print(f"run directory: {run_dir}", flush=True)
    if choice is not None:
        (run_dir / "plan.json").write_text(choice)
    # The launcher stays as torchrun's parent: it forwards stop signals and turns a
    # preemption into EXIT_PREEMPTED (torchrun itself would exit 1). DeepSpeed's
    # launcher dies on a signal before its ranks have saved: it runs in its own process
    # group, which gets the signals and is waited for as a whole; it starts the other
    # nodes itself (over ssh, from the hostfile).
    own_group = cfg.cluster.runner == C.Runner.deepspeed
    if cfg.cluster.nnodes > 1 and not own_group:  # several nodes by hand: meet the others first
        return run_node(cfg, run_dir, argv_run, {**os.environ, **env})
    if "train.micro_batch=auto" in overrides:
        return supervise_with_backoff(cfg, argv_run, {**os.environ, **env}, run_dir)
    return supervise(argv_run, {**os.environ, **env}, run_dir, own_group=own_group,
                     drain_s=cfg.cluster.shutdown_timeout_s, ckpt_root=root_of(cfg, run_dir))


def wandb_reachable_or_offline(cfg: C.Config, run_dir: Path) -> C.Config:
    """A run that would log to W&B online checks first, for a few seconds, that the server
    answers. logger.mode=auto: if not, the run logs offline (one line; config.yaml says
    offline); logger.mode=online: refused. The ranks fall back to offline on their own too
    (a key the server rejects, a network that drops; launcher/metrics.py)."""
    import dataclasses

    from launcher.metrics import sinks, wandb_mode, wandb_unreachable

    if C.LoggerKind.wandb not in sinks(cfg) or wandb_mode(cfg) != "online":
        return cfg
    problem = wandb_unreachable()
    if problem is None:
        return cfg
    if cfg.logger.mode == C.WandbMode.online:
        raise C.ConfigError("logger.mode", "online", f"{problem}; use logger.mode=auto or offline "
                                                     f"(wandb sync RUN_DIR/wandb later)")
    print(f"W&B: {problem}; this run logs offline to {run_dir / 'wandb'} (wandb sync it later)", flush=True)
    return dataclasses.replace(cfg, logger=dataclasses.replace(cfg.logger, mode=C.WandbMode.offline))


def nothing_to_train(cfg: C.Config, run_dir: Path) -> bool:
    """A launch that would resume a checkpoint already at train.steps says so in one line
    and leaves the run directory as it is (its summary.json is the run's own)."""
    from launcher.checkpoint import manifest_step, resumable

    folders = resumable(cfg, run_dir)
    step = manifest_step(folders[-1]) if folders else None
    if step is None or step < cfg.train.steps:
        return False
    print(f"nothing to train: {run_dir} has a checkpoint at step {step} of train.steps={cfg.train.steps}; "
          f"raise train.steps to train on", flush=True)
    return True


# ----------------------------------------------------------------------------- planning
def hardware(cfg: C.Config, host: HostInfo, world_from_launch: bool) -> "planner.Hardware":
    """The GPUs to plan for: the configured cluster, or this machine's."""
    from launcher import plan as planner
    from launcher.device import gpu_memory_bytes, gpu_name, table_tflops

    c = cfg.cluster
    if world_from_launch:
        gpn = C.nproc_per_node(cfg, host)
    else:
        gpn = c.gpus_per_node or (host.gpus if host.cuda else None)
        if gpn is None:
            raise C.ConfigError("cluster.gpus_per_node", None, "needed to plan on a machine without GPUs (e.g. 8)")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # this machine's memory
    mem = int(c.gpu_memory_gb * 2**30) if c.gpu_memory_gb else gpu_memory_bytes()
    if mem is None and world_from_launch and not host.cuda:  # ranks on this CPU: each gets its share of memory
        mem = ram // gpn
    if mem is None:
        raise C.ConfigError("cluster.gpu_memory_gb", None, "needed to plan on a machine without GPUs (e.g. 80)")
    tflops = cfg.plan.gpu_tflops or table_tflops(gpu_name()) or planner.DEFAULT_TFLOPS
    host_bytes = int(cfg.plan.host_memory_gb * 2**30) if cfg.plan.host_memory_gb else None
    if host_bytes is None and world_from_launch:  # planning for this machine: its memory
        host_bytes = ram
    return planner.Hardware(gpu_bytes=mem, gpus_per_node=gpn, nnodes=c.nnodes, tflops=tflops, host_bytes=host_bytes)


def available_recipes() -> set[str]:
    return set(_options("recipe"))


def recommended_command(overrides: list[str], best) -> str:
    """`make train RECIPE=.. ARGS=".."` that trains exactly the planned row: every override
    the user gave (the model, the sequence length, the cluster planned for), less the ones
    the plan chose anew and the plan's own options, then the plan's choices."""
    chosen = best.layout.overrides()[1:] + [f"train.activation_checkpointing={best.ac.value}",
                                            f"train.micro_batch={best.micro_batch}"]
    replaced = {o.split("=", 1)[0] for o in chosen} | {"recipe", "parallel.tp", "parallel.pp"}
    kept = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in replaced
            and not o.lstrip("+~").startswith("plan.") and not o.startswith("--")]
    args = " ".join(shlex.quote(o) for o in kept + chosen)
    return f'make train RECIPE={best.layout.recipe} ARGS="{args}"'


def cmd_plan(overrides: list[str], as_json: bool = False) -> int:
    """`launcher plan`: the table (or --json), optionally a chart; validates the config
    against the planned cluster, not this machine."""
    from launcher import plan as planner

    cfg, _, _ = compose_config(overrides)
    host = HostInfo.detect()
    hw = hardware(cfg, host, world_from_launch=False)
    # Checked against the cluster being planned for, not this machine: one node with all
    # its GPUs stands for it (the same data-parallel size, no rendezvous to check).
    import dataclasses

    as_one_node = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, nnodes=1, node_rank=0,
                                                                       nproc_per_node=None, gpus_per_node=hw.world))
    validate(as_one_node, HostInfo(cuda=True, gpus=hw.world, cpus=host.cpus))
    rows = planner.plan(cfg, hw, available_recipes())
    if as_json:
        print(planner.to_json(rows, hw))
    else:
        from rich.console import Console

        console = Console(width=200)
        title = (f"{cfg.model.name}: seq {cfg.train.seq_len}, {cfg.precision.name.value}, "
                 f"{hw.nnodes} node(s) x {hw.gpus_per_node} GPU(s) of {hw.gpu_bytes / 2**30:.0f} GiB")
        console.print(planner.table(rows, hw, title))
        best = planner.recommended(rows)
        if best is None:
            console.print(planner.no_fit_message(rows, hw, cfg.plan.reserve_gb), markup=False)
        else:
            console.print(f"recommended: {recommended_command(overrides, best)}", markup=False)
    if cfg.plan.chart:
        planner.chart(rows, hw, Path(cfg.plan.chart))
        if not as_json:
            print(f"chart: {cfg.plan.chart}")
    return 0


def resolve_auto(overrides: list[str], host: HostInfo) -> tuple[list[str], str | None]:
    """`recipe=auto` and `train.micro_batch=auto`: ask the planner, return the overrides
    with its choice filled in, and the plan (json) to keep in the run directory."""
    from launcher import plan as planner

    auto_recipe = "recipe=auto" in overrides
    auto_mb = "train.micro_batch=auto" in overrides
    if not (auto_recipe or auto_mb):
        return overrides, None
    rest = [o for o in overrides if o not in ("recipe=auto", "train.micro_batch=auto")]
    cfg, _, _ = compose_config(rest)
    hw = hardware(cfg, host, world_from_launch=True)
    # On a CPU the ranks' memory is the host's: offloading to it saves nothing.
    recipes = available_recipes() - (set() if host.cuda else {"zero2_offload", "zero3_offload"})
    rows = planner.plan(cfg, hw, recipes, micro_batch=None if auto_mb else cfg.train.micro_batch)
    if not auto_recipe:  # keep the user's recipe and checkpointing; choose the micro-batch
        mine = planner.layout_for(cfg, hw.world)
        rows = [r for r in rows if r.layout == mine and r.ac == cfg.train.activation_checkpointing]
    fitting = [r for r in rows if r.fits]
    if not fitting:
        raise C.ConfigError("recipe" if auto_recipe else "train.micro_batch", "auto",
                            planner.no_fit_message(rows, hw, cfg.plan.reserve_gb))
    best = min(fitting, key=lambda r: r.step_time_s / r.tokens_per_step)
    chosen = list(rest)
    if auto_recipe:
        chosen += best.layout.overrides() + [f"train.activation_checkpointing={best.ac.value}"]
    if auto_mb:
        chosen.append(f"train.micro_batch={best.micro_batch}")
    per = "per GPU" if host.cuda or cfg.cluster.gpu_memory_gb else "per rank: this machine's memory, shared"
    print(f"planner chose: {best.layout.label}, activation checkpointing {best.ac.value}, micro-batch "
          f"{best.micro_batch} ({best.peak / 2**30:.2f} of {hw.gpu_bytes / 2**30:.2f} GiB {per})", flush=True)
    record = {"chosen": chosen[len(rest):], "plan": json.loads(planner.to_json(rows, hw))}
    return chosen, json.dumps(record, indent=1)


def supervise_with_backoff(cfg: C.Config, argv: list[str], env: dict[str, str], run_dir: Path) -> int:
    """train.micro_batch=auto: when a rank runs out of memory (it leaves RUN_DIR/oom.json),
    halve the micro-batch, rewrite config.yaml and launch again (accelerate's
    find_executable_batch_size drives the retries); the run resumes from its checkpoints."""
    from accelerate.utils import find_executable_batch_size

    from launcher.exits import OOM_MARKER

    state = {"mb": cfg.train.micro_batch}

    def halve() -> int:
        state["mb"] //= 2
        return state["mb"]

    @find_executable_batch_size(starting_batch_size=cfg.train.micro_batch, reduce_batch_size_fn=halve)
    def attempt(batch_size: int) -> int:
        if batch_size != cfg.train.micro_batch:
            cfg.train.micro_batch = batch_size
            (run_dir / "config.yaml").write_text(C.to_yaml(cfg))
            print(f"out of memory: retrying with train.micro_batch={batch_size}", flush=True)
        (run_dir / OOM_MARKER).unlink(missing_ok=True)
        rc = supervise(argv, env, run_dir, ckpt_root=root_of(cfg, run_dir))
        if rc != 0 and (run_dir / OOM_MARKER).exists():
            raise RuntimeError(f"CUDA out of memory. {(run_dir / OOM_MARKER).read_text().strip()}")
        return rc

    rc = attempt()
    print(f"micro-batch settled at {cfg.train.micro_batch}", flush=True)
    return rc


def run_node(cfg: C.Config, run_dir: Path, argv: list[str], env: dict[str, str]) -> int:
    """One node of a multi-node run started by hand: meet the other nodes' launchers
    first (a node that never comes is named), then supervise this node's torchrun."""
    from launcher.rendezvous import NodeRendezvous, RendezvousFailed

    try:
        with NodeRendezvous(cfg, run_dir) as meeting:
            print(f"node {cfg.cluster.node_rank}: all {cfg.cluster.nnodes} nodes joined "
                  f"({meeting.describe()})", flush=True)
            return supervise(argv, env, run_dir, ckpt_root=root_of(cfg, run_dir))
    except RendezvousFailed as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1


def slurm_plan(cfg: C.Config, host: HostInfo) -> LaunchPlan:
    """A job's plan: ranks per node from the nodes it asks for; threads from its CPUs."""
    nproc = C.nproc_per_node(cfg, host)
    c = cfg.cluster
    threads = c.cpu_threads or (max(1, c.cpus_per_task // nproc) if c.cpus_per_task else 1)
    return LaunchPlan(python=sys.executable, nproc_per_node=nproc, master_port=c.master_port or 0,
                      threads_per_rank=threads, workdir=os.getcwd())


def cmd_submit(overrides: list[str], multirun: bool, dry_run: bool = False) -> int:
    """`launcher submit`: per point, RUN_DIR/config.yaml + job.sbatch, then sbatch.
    --dry-run prints the script and submits nothing."""
    jobs = compose_jobs("submit", overrides, multirun, dry_run)
    for cfg, run_dir, host, choice, ds in jobs:
        script = sbatch_script(cfg, str(run_dir), slurm_plan(cfg, host))
        if dry_run:
            print(script, end="")
            continue
        created = not run_dir.exists()
        # Nobody trains there while the job's files are written and the job id recorded (the
        # job's rank 0 takes the lock when it starts, seconds later). A job queued for it: refused.
        try:
            with runlock.hold(run_dir):
                runlock.check_free(run_dir)
                cfg = identity.settle(cfg, run_dir)  # the job's frozen config names its run
                write_run_dir(cfg, run_dir, {slurm.SCRIPT: script}, run_files(cfg, slurm_plan(cfg, host), ds))
                if choice is not None:  # recipe=auto / micro_batch=auto: what the planner chose, and why
                    (run_dir / "plan.json").write_text(choice)
                job_id = slurm.submit(run_dir)
        except slurm.SubmitError as e:
            if created:  # nothing ran: leave nothing behind
                shutil.rmtree(run_dir, ignore_errors=True)
            print(f"error: sbatch refused the job for {run_dir}: {e}", file=sys.stderr)
            return 2
        except BaseException:
            if created:
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
        print(f"submitted job {job_id}: run directory {run_dir}, log {slurm.log_path(run_dir, job_id)}", flush=True)
    return 0


def zero_config(cfg: C.Config, host: HostInfo) -> dict | None:
    """recipe.strategy=zero: DeepSpeed's config, generated, merged with recipe.zero.extra and
    checked by DeepSpeed's parser at the world size of this launch (ConfigError if not)."""
    if cfg.recipe.strategy != C.Strategy.zero:
        return None
    from launcher import ds_config
    from launcher.device import deepspeed_env

    deepspeed_env()
    world = C.nproc_per_node(cfg, host) * cfg.cluster.nnodes
    return ds_config.launch_config(cfg, world, host.cuda)


def cmd_export(args: list[str]) -> int:
    """`launcher export RUN_DIR [export.key=value ...]`: consolidated weights."""
    from launcher.export import export

    if not args or "=" in args[0]:
        raise UsageError("usage: launcher export RUN_DIR [export.format=safetensors export.dtype=fp32|bf16 "
                         "export.step=N export.out=DIR]")
    run_dir = Path(args[0]).resolve()
    if not (run_dir / "config.yaml").is_file():
        raise C.ConfigError("RUN", args[0], "not a run directory (no config.yaml in it)")
    for o in args[1:]:
        if not o.startswith("export."):
            raise C.ConfigError(o.split("=", 1)[0], o.split("=", 1)[-1], "export takes only export.* options")
    out = export(run_dir, args[1:])
    dtype = next((o.split("=", 1)[1] for o in args[1:] if o.startswith("export.dtype=")), "fp32")
    print(f"exported {out} ({dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Launch side: `launcher train [overrides...] [--dry-run] [-m]`.

One process that never touches a GPU: compose the Hydra config once, validate it, make
the run directory (config.yaml, command.sh), then exec torchrun. Bad input ends here
with one line on stderr and exit code 2, before any rank starts.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException, MissingConfigException
from omegaconf import OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from launcher import config as C
from launcher.commands import HOSTFILE, LaunchPlan, command_script, hostfile_text, launch_argv, rank_env
from launcher.device import HostInfo
from launcher.preempt import supervise

REPO = Path(__file__).resolve().parent.parent
CONF_DIR = REPO / "conf"
COMMANDS = ("train", "export")
USAGE = """usage: launcher train [key=value ...] [--dry-run] [-m|--multirun]
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
                return f"{group}={name}: no such {group}; allowed: {', '.join(_options(group))}"
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


def check_writable(run_dir: Path) -> None:
    """The run directory can be made (or is writable) -- found here, not on a rank."""
    probe = run_dir
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise C.ConfigError("hydra.run.dir", str(run_dir), f"cannot write under {probe}; choose a writable folder")


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
    env = rank_env(plan)
    created = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(C.to_yaml(cfg))
        for name, text in (files or {}).items():
            (run_dir / name).write_text(text)
        script = run_dir / "command.sh"
        script.write_text(command_script(argv, env, plan.workdir, str(run_dir)))
        script.chmod(0o755)
    except OSError as err:
        if created:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise C.ConfigError("hydra.run.dir", str(run_dir), f"cannot write the run directory ({err.strerror})")
    return argv, env


# ----------------------------------------------------------------------------- main
def parse_args(argv: list[str]) -> tuple[str, list[str], bool, bool]:
    command = "train"
    if argv and not argv[0].startswith("-") and "=" not in argv[0]:
        command = argv[0]
        argv = argv[1:]
        if command not in COMMANDS:
            raise UsageError(f"unknown command '{command}'; allowed: {', '.join(COMMANDS)}")
    dry = multirun = False
    overrides = []
    for a in argv:
        if a == "--dry-run":
            dry = True
        elif a in ("-m", "--multirun"):
            multirun = True
        elif a.startswith("-"):
            raise UsageError(f"unknown flag '{a}'; allowed: --dry-run, -m/--multirun, or key=value overrides")
        else:
            overrides.append(a)
    if dry:
        overrides.append("dry_run=true")
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for o in overrides if command == "train" else []:
        try:
            parser.parse_overrides([o])
        except HydraException as e:
            raise UsageError(f"{o}: cannot parse ({str(e).splitlines()[0]}); overrides look like key=value")
    return command, overrides, dry, multirun


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    try:
        command, overrides, _, multirun = parse_args(argv)
        if command == "export":
            return cmd_export(overrides)
        return cmd_train(overrides, multirun)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (C.ConfigError, HydraException, OmegaConfBaseException, ValueError) as e:
        print(f"error: {describe(e)}", file=sys.stderr)
        return 2


def cmd_train(overrides: list[str], multirun: bool) -> int:
    """Compose and validate every point first (bad input starts nothing), then run each."""
    host = HostInfo.detect()
    jobs = []
    for i, point in enumerate(expand_sweep(overrides) if multirun else [overrides]):
        cfg, run_dir, hydra_node = compose_config(point)
        if multirun:
            run_dir = Path(str(hydra_node.sweep.dir)) / str(i)
        run_dir = run_dir.resolve()
        C.validate(cfg, host)
        ds = zero_config(cfg, host)
        check_writable(run_dir)
        jobs.append((cfg, run_dir, ds))

    rc = 0
    for cfg, run_dir, ds in jobs:
        plan = make_plan(cfg, host)
        files = run_files(cfg, plan, ds)
        if cfg.dry_run:
            print(C.to_yaml(cfg), end="")
            for name, text in files.items():
                print(f"# {name}")
                print(text, end="")
            print("# command")
            print(command_script(launch_argv(cfg, str(run_dir), plan), rank_env(plan), plan.workdir,
                                 str(run_dir)), end="")
            continue
        argv_run, env = prepare_run(cfg, run_dir, plan, files)
        print(f"run directory: {run_dir}", flush=True)
        # The launcher stays as torchrun's parent: it forwards stop signals and turns a
        # preemption into EXIT_PREEMPTED (torchrun itself would exit 1). DeepSpeed's
        # launcher dies on a signal before its ranks have saved: it runs in its own process
        # group, which gets the signals and is waited for as a whole.
        own_group = cfg.cluster.runner == C.Runner.deepspeed
        rc = max(rc, supervise(argv_run, {**os.environ, **env}, run_dir, own_group=own_group,
                               drain_s=cfg.cluster.shutdown_timeout_s))
    return rc


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
    print(f"exported {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

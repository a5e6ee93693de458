"""The run directory on the launch side: what is checked before anything is written (a
writable folder, room for the checkpoints, checkpoint files that are data, a plain name),
the files written into it (config.yaml, command.sh, ds_config.json), the data prepared
once, and a relaunch that has nothing to train.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import engines
from launcher import config as C
from launcher import models
from launcher.host import HostInfo, deepspeed_env
from launcher.launch.start.argv import (
    ACCELERATE_CONFIG,
    HOSTFILE,
    LaunchPlan,
    accelerate_config_text,
    command_script,
    hostfile_text,
    launch_argv,
    launch_env,
)
from launcher.manifest import complete_checkpoints, manifest_step, resumable, root_of, verify
from launcher.parallel import ds_config
from launcher.untrusted import check_checkpoint


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_plan(cfg: C.Config, host: HostInfo) -> LaunchPlan:
    nproc = C.nproc_per_node(cfg, host)
    threads = cfg.cluster.cpu_threads or exported_threads() or max(1, host.cpus // nproc)
    port = cfg.cluster.master_port or free_port()
    return LaunchPlan(
        python=sys.executable, nproc_per_node=nproc, master_port=port, threads_per_rank=threads, workdir=os.getcwd()
    )


def exported_threads() -> int | None:
    """OMP_NUM_THREADS of the launching shell, the threads each rank takes where
    cluster.cpu_threads is not set (as torchrun keeps it): a user's export is not overridden."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise C.ConfigError(
            "OMP_NUM_THREADS",
            value,
            "a positive integer (threads per rank), or unset it (then cluster.cpu_threads, else cores / processes)",
        )
    return int(value)


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
    low-precision copy, 16 bytes for each parameter of the model as it will be built:
    the project's decoder counted from its shape (C.num_params, equal to the built
    model's count), model=hf from its meta-device build (the Hugging Face model itself)."""
    if cfg.model.kind != C.ModelKind.hf:
        return 16 * C.num_params(cfg.model)

    return 16 * sum(p.numel() for p in models.on_meta(cfg).parameters())


def checkpoints_written(cfg: C.Config) -> int:
    """The most checkpoints one launch writes: one every checkpoint.every steps and one
    at the end (the last step, or the step where a preemption or train.stop_at stops
    it early, which takes the place of every later one): ceil(steps / every), or 1 when
    only the end saves. A resumed launch writes fewer; this counts from step 0."""
    every, steps = cfg.checkpoint.every, cfg.train.steps
    return max(1, -(-steps // every)) if every else 1


def check_checkpoint_space(cfg: C.Config, run_dir: Path, dry_run: bool = False) -> str | None:
    """The checkpoint folder is writable and its disk has room for the checkpoints that
    can exist at once: keep + 1 (the newest is written before the oldest is deleted), or
    fewer when the run's complete ones and the ones this launch writes are fewer; found
    here, not mid-run. A dry run (a plan, perhaps for another machine's disk: the planner's
    recommended command) gets the shortfall as a note, checked again when it launches."""
    root = root_of(cfg, run_dir)
    probe = writable_parent(root, "checkpoint.dir")
    each = checkpoint_bound(cfg)
    done = complete_checkpoints(root)
    existing = sum(f.stat().st_size for d in done for f in d.rglob("*") if f.is_file())
    at_once = min(cfg.checkpoint.keep + 1, len(done) + checkpoints_written(cfg))
    need = max(each, each * at_once - existing)
    free = shutil.disk_usage(probe).free
    if free >= need:
        return None
    written = checkpoints_written(cfg)
    fewer = "lower checkpoint.keep, raise checkpoint.every, " if at_once > 1 else ""
    what = (
        f"{at_once} checkpoints at once (keep={cfg.checkpoint.keep}, {written} written by this run) of up to "
        f"{each / 2**30:.2f} GiB need"
        if at_once > 1
        else f"a checkpoint of up to {each / 2**30:.2f} GiB needs"
    )
    if dry_run:
        return (
            f"checkpoint.dir={root}: {what} {need / 2**30:.2f} GiB, {free / 2**30:.2f} GiB free on this machine "
            f"(a dry run: the disk of the machine that launches it is checked there)"
        )
    raise C.ConfigError(
        "checkpoint.dir",
        str(root),
        f"{free / 2**30:.2f} GiB free, but {what} {need / 2**30:.2f} GiB; "
        f"free space, {fewer}or choose another checkpoint.dir",
    )


def schedule_change(cfg: C.Config, run_dir: Path) -> str | None:
    """A launch that continues a run with another train.steps or optim.warmup_steps (say,
    more steps for a run whose warm-up was clamped to its length) changes the learning
    rate at the step it resumes from: said in one line, None when it stays the same."""
    frozen, folders = run_dir / "config.yaml", resumable(cfg, run_dir)
    if not folders or not frozen.is_file():
        return None
    step, old = manifest_step(folders[-1]), C.load_frozen(frozen)
    was, now = C.lr_factor(step, old.train.steps, old.optim), C.lr_factor(step, cfg.train.steps, cfg.optim)
    if abs(was - now) <= 0.01 * max(was, now):
        return None
    return (
        f"the learning rate where this launch resumes (step {step}) changes from {was:.3g} to {now:.3g} x "
        f"optim.lr: the run had train.steps={old.train.steps} optim.warmup_steps={old.optim.warmup_steps}, this "
        f"launch train.steps={cfg.train.steps} optim.warmup_steps={cfg.optim.warmup_steps}"
    )


def check_resume_is_data(cfg: C.Config, run_dir: Path) -> None:
    """Every checkpoint the ranks may resume from can be read without running code
    (launcher/untrusted.py): a crafted file is refused here, in one line, before any rank
    starts. Only pickles' small parts are read (no digests, no tensor data)."""
    for folder in resumable(cfg, run_dir):
        problem = check_checkpoint(folder)
        if problem:
            raise C.ConfigError("checkpoint.resume", cfg.checkpoint.resume, problem)


def run_files(cfg: C.Config, plan: LaunchPlan, ds: dict | None) -> dict[str, str]:
    """Files besides config.yaml the ranks or the runner read: ds_config.json (ZeRO), the
    hostfile (runner=deepspeed on several nodes), accelerate_config.yaml (runner=accelerate)."""
    files = {}
    if ds is not None:
        files[ds_config.FILE] = ds_config.text(ds)
    if cfg.cluster.runner == C.Runner.deepspeed and cfg.cluster.nnodes > 1:
        files[HOSTFILE] = hostfile_text(cfg, plan)
    if cfg.cluster.runner == C.Runner.accelerate:
        files[ACCELERATE_CONFIG] = accelerate_config_text(cfg, plan)
    return files


def prepare_run(
    cfg: C.Config, run_dir: Path, plan: LaunchPlan, files: dict[str, str] | None = None
) -> tuple[list[str], dict[str, str]]:
    """Write RUN_DIR/config.yaml, command.sh and `files`; return the command and its
    environment. A failure here removes a run directory this call created."""
    argv = launch_argv(cfg, str(run_dir), plan)
    env = launch_env(cfg, plan, str(run_dir))
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
    prepared = cfg.data.name in (C.DataKind.hf_text, C.DataKind.chat)
    if prepared and cfg.cluster.node_rank == 0:
        prepare_data(cfg, run_dir, created)
    elif prepared:  # node 0's launcher prepares; this node's ranks start after it
        print(
            f"node {cfg.cluster.node_rank}: data={cfg.data.name.value} is prepared by node 0 (its ranks read "
            f"{run_dir / 'data' / cfg.data.name.value}.json); for a large corpus run `make data` first, so the nodes do not "
            f"wait for it in the rendezvous (cluster.join_timeout_s)",
            flush=True,
        )
    return created


def prepare_data(cfg: C.Config, run_dir: Path, created: bool) -> None:
    """data=hf_text, chat: prepared once, here, before any rank starts, into the shared cache
    (reused when `make data` or another run prepared the same inputs; the ranks read the
    directory RUN_DIR/data/<data.name>.json names). A failure removes a run directory this
    launch created."""
    from launcher.data.prepare import prepare_cache  # local: start-up (numpy, 0.75 s, launch side)

    try:
        print(prepare_cache(cfg, run_dir), flush=True)
    except (C.ConfigError, OSError) as err:
        if created:
            shutil.rmtree(run_dir, ignore_errors=True)
        if isinstance(err, OSError):
            raise C.ConfigError("data.files", cfg.data.files, f"the prepared data could not be written ({err})")
        raise


def check_run_dir_name(run_dir: Path) -> None:
    """The run directory's path goes into scripts (quoted): a line break would end a comment."""
    if any(ch in str(run_dir) for ch in "\n\r\0"):
        raise C.ConfigError("hydra.run.dir", repr(str(run_dir)), "a path without line breaks")


def nothing_to_train(cfg: C.Config, run_dir: Path) -> bool:
    """A launch that would resume a checkpoint already at train.steps says so in one line
    and leaves the run directory as it is (its summary.json is the run's own)."""
    folders = resumable(cfg, run_dir)
    step = manifest_step(folders[-1]) if folders else None
    if step is None or step < cfg.train.steps:
        return False
    problem = verify(folders[-1], threads=min(8, os.cpu_count() or 1))  # what it believes, by its digests
    if problem is not None:
        print(
            f"checkpoint {folders[-1]} fails its check ({problem}): the ranks set it aside and resume from the "
            f"newest one that passes",
            flush=True,
        )
        return False
    print(
        f"nothing to train: {run_dir} has a checkpoint at step {step} of train.steps={cfg.train.steps}; "
        f"raise train.steps to train on",
        flush=True,
    )
    return True


def for_backend(cfg: C.Config, host: HostInfo) -> C.Config:
    """A zero recipe's null reduce bucket resolved for the backend its ranks use
    (ds_config.for_backend: gloo or NCCL), so that config.yaml, ds_config.json and the CPU
    fit all read one number; any other recipe as it is."""
    if not engines.spec(cfg.recipe.engine).deepspeed:
        return cfg
    return ds_config.for_backend(cfg, ds_config.on_gloo(cfg, host.cuda))


def zero_config(cfg: C.Config, host: HostInfo) -> dict | None:
    """An engine that runs inside DeepSpeed (its EngineSpec says so: recipe.engine=zero):
    DeepSpeed's config, generated, merged with recipe.zero.extra and checked by DeepSpeed's
    parser at the world size of this launch (ConfigError if not)."""
    if not engines.spec(cfg.recipe.engine).deepspeed:
        return None

    deepspeed_env()
    world = C.nproc_per_node(cfg, host) * cfg.cluster.nnodes
    return ds_config.launch_config(cfg, world, host.cuda)

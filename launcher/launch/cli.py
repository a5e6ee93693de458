"""Launch side: `launcher train [overrides...] [--dry-run] [-m]` (and plan, rehearse, submit, data, export).

One process that never touches a GPU: compose the Hydra config once, validate it, make
the run directory (config.yaml, command.sh), then exec torchrun. Bad input ends here
with one line on stderr and exit code 2, before any rank starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from launcher import config as C
from launcher import offline, ops, provenance, runlock
from launcher.exits import EXIT_INTERRUPTED, OOM_MARKER
from launcher.host import HostInfo
from launcher.launch.args import USAGE, parse_args
from launcher.launch.checks import asked, fit, plaintext
from launcher.launch.checks.levers import check_trainable
from launcher.launch.checks.validate import validate
from launcher.launch.commands import sweep
from launcher.launch.commands.data import cmd_data
from launcher.launch.commands.export import cmd_export
from launcher.launch.commands.plan import check_cpu_fit, cmd_plan, cmd_rehearse, planned_host, resolve_auto
from launcher.launch.compose import UsageError, compose_config, describe, expand_sweep
from launcher.launch.rundir import identity
from launcher.launch.rundir.prepare import (
    check_checkpoint_space,
    check_resume_is_data,
    check_run_dir_name,
    check_writable,
    exported_threads,
    for_backend,
    make_plan,
    nothing_to_train,
    prepare_run,
    run_files,
    schedule_change,
    write_run_dir,
    zero_config,
)
from launcher.launch.start.argv import SLURM_STEPS, LaunchPlan, command_script, launch_argv, launch_env, sbatch_script
from launcher.launch.start.rendezvous import NodeRendezvous, RendezvousFailed, check_master_addr
from launcher.launch.start.supervise import interrupts_held, supervise
from launcher.launch.submit import k8s, slurm
from launcher.manifest import lock_folders, root_of
from launcher.parallel import ds_config
from launcher.parallel.degrees import back_off


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    offline()  # nothing is fetched from a model or dataset hub; torchrun and the ranks inherit it
    try:
        args = parse_args(argv)
        if args.help:
            print(args.help, end="")
            return 0
        if args.command == "export":
            return cmd_export(args.overrides)
        if args.command == "plan":
            with interrupts_held():
                return cmd_plan(args.overrides, args.as_json)
        if args.command == "rehearse":
            return cmd_rehearse(args.overrides, args.as_json, args.ranks)
        if args.command == "submit":
            return cmd_submit(args.overrides, args.multirun, args.dry_run)
        if args.command == "data":
            return cmd_data(args.overrides)
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


def compose_jobs(
    command: str, overrides: list[str], multirun: bool, dry_run: bool = False
) -> tuple[list[tuple[C.Config, Path, HostInfo, str | None, dict | None]], list[str]]:
    """`train` and `submit` alike: compose and validate every point of a sweep first (bad
    input starts nothing and writes nothing); each point gets its own run directory. Returns
    the jobs and the warnings, which the command prints once nothing can refuse the launch
    any more (bad input stays one line)."""
    with interrupts_held():  # the lazy imports of validation (torch, the engines, DeepSpeed)
        here = HostInfo.detect()
        if command == "submit" and not any(o.split("=", 1)[0].lstrip("+~") == "cluster" for o in overrides):
            overrides = ["cluster=slurm", *overrides]
        jobs, sweep_dir, notes = [], None, []
        for i, point in enumerate(expand_sweep(overrides) if multirun else [overrides]):
            point, choice = resolve_auto(point, planned_host(command, point, here))
            cfg, run_dir, hydra_node = compose_config(point)
            if multirun:  # one sweep folder, resolved once (its ${now:} would move on between points)
                sweep_dir = sweep_dir or Path(str(hydra_node.sweep.dir))
                run_dir = sweep_dir / str(i)
            run_dir = run_dir.resolve()
            check_command(command, cfg, point, multirun)
            # A Slurm job is validated against the nodes it asks for, not this login machine; a
            # dry run naming GPUs this machine lacks (the planner's command), against those.
            host = slurm.node_host(cfg, here) if command == "submit" else here
            if command == "train" and dry_run:
                host, note = planned_nodes(cfg, here)
                notes.append(note)
            names = asked.named(point)
            cfg, kept, settled = asked.keep_run_values(cfg, names, run_dir, host)  # a relaunch: the run's own values
            cfg, note = asked.fit_precision(cfg, names | settled, host)
            notes += [kept, note, *validate(cfg, host)]
            cfg = for_backend(cfg, host)  # a zero recipe's reduce bucket, for gloo or NCCL
            asked.check_data_keys(cfg, names)
            if command == "train":
                check_cpu_fit(cfg, host)
            if command == "submit" and cfg.cluster.scheduler == C.Scheduler.k8s:
                k8s.validate_k8s(cfg, run_dir)
            plaintext.check(cfg)
            plaintext.check_remote_shell(cfg, run_dir, os.getcwd())
            check_run_dir_name(run_dir)
            check_writable(run_dir)
            notes.append(check_checkpoint_space(cfg, run_dir, dry_run))
            check_resume_is_data(cfg, run_dir)
            identity.decide(cfg, run_dir)  # a fresh start into another run's checkpoints: refused here
            fit.check(cfg, run_dir)  # a checkpoint of another shape or format: refused here
            notes.append(schedule_change(cfg, run_dir))
            jobs.append((cfg, run_dir, host, choice, zero_config(cfg, host)))
        if command == "submit" and not dry_run and any(j[0].cluster.scheduler == C.Scheduler.slurm for j in jobs):
            slurm.check_client()
        if command == "train":
            exported_threads()  # the launching shell's OMP_NUM_THREADS, which each rank would take
    return jobs, list(dict.fromkeys(n for n in notes if n))


def say(notes: list[str]) -> None:
    """compose_jobs' warnings, once every check passed."""
    for note in notes:
        print(f"warning: {note}", file=sys.stderr, flush=True)


def planned_nodes(cfg: C.Config, here: HostInfo) -> tuple[HostInfo, str | None]:
    """`train --dry-run` of a run for GPUs this machine does not have (cluster.gpus_per_node:
    the planner's recommended command, pasted on the machine that planned it): checked as a
    plan for such a node, and a line saying what only that node can answer."""
    gpus = cfg.cluster.gpus_per_node
    if gpus is None or here.cuda and here.gpus >= gpus:
        return here, None
    has = f"{here.gpus} GPU(s)" if here.cuda else "no GPU"
    return HostInfo(cuda=True, gpus=gpus, cpus=here.cpus), (
        f"checked as a plan for nodes of {gpus} GPUs (cluster.gpus_per_node={gpus}); this machine has {has}: "
        f"the GPUs, their memory and the checkpoint disk are checked where it launches"
    )


def check_command(command: str, cfg: C.Config, point: list[str], multirun: bool) -> None:
    """The config fits the command: Slurm configs are submitted, others trained here."""
    if cfg.model.lora.rank > 0:
        check_trainable(cfg)
    c = cfg.cluster
    kind = {C.Scheduler.slurm: "Slurm", C.Scheduler.k8s: "Kubernetes"}.get(c.scheduler)
    if command == "train" and kind:
        raise C.ConfigError(
            "cluster.scheduler",
            c.scheduler.value,
            f"cluster={c.name} is a {kind} config: submit it "
            "with `make submit` (launcher submit), or train here with cluster=local",
        )
    if command == "submit":
        if not kind:
            raise C.ConfigError(
                "cluster.scheduler",
                c.scheduler.value,
                f"cluster={c.name} is not a Slurm config; submit needs one, e.g. cluster=slurm (or cluster=k8s)",
            )
        if c.runner not in SLURM_STEPS:
            raise C.ConfigError(
                "cluster.runner", c.runner.value, f"submit supports: {', '.join(r.value for r in SLURM_STEPS)}"
            )
    if command == "train" and c.runner == C.Runner.accelerate:
        check_accelerate(cfg)
    if command == "train" and c.nnodes > 1 and c.runner != C.Runner.deepspeed:  # deepspeed: one launch for all
        key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
        if not any(o.startswith(key + "=") for o in point):
            raise C.ConfigError(
                key,
                "(default: a timestamp)",
                f"a run over cluster.nnodes={c.nnodes} nodes needs the same {key}=... on every node "
                "(a folder they share)",
            )

        check_master_addr(cfg)


def check_accelerate(cfg: C.Config) -> None:
    """cluster.runner=accelerate: one node (accelerate launch on node 0 refuses a port in use,
    and the nodes' launchers meet on it first: launcher/launch/start/rendezvous.py), and accelerate
    importable by this interpreter, which runs it (found, not imported: it imports torch)."""
    if cfg.cluster.nnodes > 1:
        raise C.ConfigError(
            "cluster.runner",
            "accelerate",
            f"accelerate launch starts one node's ranks here, not "
            f"cluster.nnodes={cfg.cluster.nnodes}: several nodes run with cluster.runner=torchrun",
        )
    if importlib.util.find_spec("accelerate") is None:
        raise C.ConfigError(
            "cluster.runner",
            "accelerate",
            f"accelerate is not installed for {sys.executable} "
            "(pip install accelerate, or the project's hf extra); or use cluster.runner=torchrun",
        )


def cmd_train(overrides: list[str], multirun: bool, dry_run: bool = False) -> int:
    """Compose and validate every point first (bad input starts nothing), then run each; a
    sweep's points are named by their swept values and compared in one table at the end."""
    (jobs, notes), rc, points = compose_jobs("train", overrides, multirun, dry_run), 0, []
    if dry_run:
        say(notes)
    names = sweep.point_names(expand_sweep(overrides)) if multirun else [""]
    for k, ((cfg, run_dir, host, choice, ds), name) in enumerate(zip(jobs, names), 1):
        if name and cfg.run_name is None:  # W&B's name and the summary's title: the swept values
            cfg = dataclasses.replace(cfg, run_name=name)
        if multirun:
            print(f"{'# ' if dry_run else ''}sweep point {k}/{len(jobs)}: {name or '(nothing swept)'}", flush=True)
        plan = make_plan(cfg, host)
        files = run_files(cfg, plan, ds)
        if dry_run:
            print(C.to_yaml(cfg), end="")
            for name, text in files.items():
                print(f"# {name}")
                print(text, end="")
            print("# command")
            print(
                command_script(
                    launch_argv(cfg, str(run_dir), plan),
                    launch_env(cfg, plan, str(run_dir)),
                    plan.workdir,
                    str(run_dir),
                ),
                end="",
            )
            continue
        if nothing_to_train(cfg, run_dir):
            points.append(sweep.Point(name, run_dir))
            continue
        if ds is not None:  # a DeepSpeed recipe: its ops compiled here, once per environment, not in the ranks
            ops.build(ops.needed(cfg, host.cuda))
        created = not run_dir.exists()
        with contextlib.ExitStack() as held:
            owner = cfg.cluster.node_rank == 0  # the other nodes of a launch by hand share node 0's directory
            try:
                if owner:  # the run directory and the checkpoint folder: one writer in each
                    held.enter_context(runlock.hold_all(lock_folders(cfg, run_dir)))
                    runlock.check_free(run_dir)  # a Slurm job queued for it would start into this run
                points.append(sweep.Point(name, run_dir, started=time.time()))
                points[-1].rc = launch_job(cfg, run_dir, plan, files, choice, overrides, notes)
                notes = []  # said once, before the first point's ranks
                rc = max(rc, points[-1].rc)
            except (C.ConfigError, runlock.Held):  # refused before any rank started: leave no trace
                if created and owner:
                    held.close()
                    shutil.rmtree(run_dir, ignore_errors=True)
                raise
    if len(points) > 1:
        sweep.print_comparison(points)
    return rc


def launch_job(
    cfg: C.Config,
    run_dir: Path,
    plan: LaunchPlan,
    files: dict[str, str],
    choice: str | None,
    overrides: list[str],
    notes: list[str],
) -> int:
    """Write the run directory (and prepare its data), say the launch's warnings, and run the
    ranks under supervision; the exit code."""
    if cfg.cluster.node_rank == 0:  # the other nodes of a launch by hand run what node 0 settles
        cfg = identity.settle(cfg, run_dir)
    cfg = wandb_reachable_or_offline(cfg, run_dir)
    argv_run, env = prepare_run(cfg, run_dir, plan, files)
    say(notes)  # nothing refuses the launch any more
    provenance.write(run_dir, ["train", *overrides], cfg.cluster.node_rank)
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
    if cfg.train.oom_backoff:
        return supervise_with_backoff(cfg, argv_run, {**os.environ, **env}, run_dir)
    return supervise(
        argv_run,
        {**os.environ, **env},
        run_dir,
        own_group=own_group,
        drain_s=cfg.cluster.shutdown_timeout_s,
        ckpt_root=root_of(cfg, run_dir),
    )


def wandb_reachable_or_offline(cfg: C.Config, run_dir: Path) -> C.Config:
    """A run that would log to W&B online checks first, for a few seconds, that the server
    answers. logger.mode=auto: if not, the run logs offline (one line; config.yaml says
    offline); logger.mode=online: refused. The ranks fall back to offline on their own too
    (a key the server rejects, a network that drops; launcher/rank/metrics.py)."""
    from launcher.rank.metrics import sinks, wandb_mode, wandb_unreachable  # local: side (launch -> rank)

    if C.LoggerKind.wandb not in sinks(cfg) or wandb_mode(cfg) != "online":
        return cfg
    problem = wandb_unreachable()
    if problem is None:
        return cfg
    if cfg.logger.mode == C.WandbMode.online:
        raise C.ConfigError(
            "logger.mode", "online", f"{problem}; use logger.mode=auto or offline (wandb sync RUN_DIR/wandb later)"
        )
    print(f"W&B: {problem}; this run logs offline to {run_dir / 'wandb'} (wandb sync it later)", flush=True)
    return dataclasses.replace(cfg, logger=dataclasses.replace(cfg.logger, mode=C.WandbMode.offline))


def supervise_with_backoff(cfg: C.Config, argv: list[str], env: dict[str, str], run_dir: Path) -> int:
    """train.oom_backoff: a rank that ran out of memory and could not back off in place
    leaves RUN_DIR/oom.json; the launcher takes the next smaller micro-batch with the
    accumulation that keeps the global batch (degrees.backed_off), records it in config.yaml
    and launches again: the ranks resume from the last checkpoint, on the same samples."""
    marker = run_dir / OOM_MARKER
    while True:
        marker.unlink(missing_ok=True)
        rc = supervise(argv, env, run_dir, ckpt_root=root_of(cfg, run_dir))
        if rc == 0 or not marker.exists():
            return rc
        oom = json.loads(marker.read_text())
        cfg = C.load_frozen(run_dir / "config.yaml")  # a rank may have backed off in place before
        smaller = back_off(cfg, oom["micro_batch"], oom["grad_accum"])
        if smaller is None:
            print(
                f"out of memory on rank {oom['rank']} at step {oom['step']} with train.micro_batch=1: "
                f"nothing left to back off ({oom['error']})",
                file=sys.stderr,
                flush=True,
            )
            return rc
        C.write_frozen(run_dir, cfg)
        if (run_dir / ds_config.FILE).is_file():  # DeepSpeed's own accumulation: its file says it too
            ds_config.rebatch(run_dir, *smaller)
        print(
            f"out of memory on rank {oom['rank']} at step {oom['step']} with micro-batch {oom['micro_batch']} x "
            f"{oom['grad_accum']}: launching again from the last checkpoint with train.micro_batch={smaller[0]}, "
            f"grad_accum {smaller[1]} (the global batch kept)",
            flush=True,
        )


def run_node(cfg: C.Config, run_dir: Path, argv: list[str], env: dict[str, str]) -> int:
    """One node of a multi-node run started by hand: meet the other nodes' launchers
    first (a node that never comes is named), then supervise this node's torchrun."""
    try:
        with NodeRendezvous(cfg, run_dir) as meeting:
            print(
                f"node {cfg.cluster.node_rank}: all {cfg.cluster.nnodes} nodes joined ({meeting.describe()})",
                flush=True,
            )
            return supervise(argv, env, run_dir, ckpt_root=root_of(cfg, run_dir))
    except RendezvousFailed as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1


def slurm_plan(cfg: C.Config, host: HostInfo, code: str | None = None, python: str = sys.executable) -> LaunchPlan:
    """A job's plan (Slurm or Kubernetes): ranks per node from the nodes it asks for; threads
    from its CPUs; `code`: the copy of the project it imports (slurm.code_dir); `python`:
    the nodes' interpreter (a pod's is the image's)."""
    nproc = C.nproc_per_node(cfg, host)
    c = cfg.cluster
    threads = c.cpu_threads or (max(1, c.cpus_per_task // nproc) if c.cpus_per_task else 1)
    return LaunchPlan(
        python=python,
        nproc_per_node=nproc,
        master_port=c.master_port or 0,
        threads_per_rank=threads,
        workdir=os.getcwd(),
        code=code,
    )


def cmd_submit(overrides: list[str], multirun: bool, dry_run: bool = False) -> int:
    """`launcher submit`: per point, RUN_DIR/config.yaml + job.sbatch, then sbatch.
    --dry-run prints the script and submits nothing."""
    jobs, notes = compose_jobs("submit", overrides, multirun, dry_run)
    if dry_run:
        say(notes)
    for cfg, run_dir, host, choice, ds in jobs:
        code, kube = slurm.code_dir(cfg, run_dir), cfg.cluster.scheduler == C.Scheduler.k8s
        name = k8s.MANIFEST if kube else slurm.SCRIPT  # the pods run the image's interpreter, the nodes ours
        script = (
            k8s.render(cfg, str(run_dir), slurm_plan(cfg, host, code, cfg.cluster.k8s.python))
            if kube
            else sbatch_script(cfg, str(run_dir), slurm_plan(cfg, host, code))
        )
        if dry_run:
            print(script, end="")
            continue
        created = not run_dir.exists()
        # Nobody trains there while the job's files are written and the job id recorded (the
        # job's rank 0 takes the lock when it starts, seconds later). A job queued for it: refused.
        # The checkpoint folder's lock too, as train takes it: an archive never moves a live run's.
        try:
            with runlock.hold_all(lock_folders(cfg, run_dir)):
                runlock.check_free(run_dir)
                cfg = identity.settle(cfg, run_dir)  # the job's frozen config names its run
                files = {**run_files(cfg, slurm_plan(cfg, host), ds), **({name: script} if kube else {})}
                write_run_dir(cfg, run_dir, {} if kube else {name: script}, files)
                if code is not None:  # what the job (and every requeue of it) imports
                    slurm.snapshot_code(run_dir)
                provenance.write(run_dir, ["submit", *overrides], 0, code=Path(code) if code else None)
                if choice is not None:  # recipe=auto / micro_batch=auto: what the planner chose, and why
                    (run_dir / "plan.json").write_text(choice)
                job_id = k8s.apply(cfg, run_dir) if kube else slurm.submit(run_dir)
        except (slurm.SubmitError, k8s.SubmitError) as e:
            if created:  # nothing ran: leave nothing behind
                shutil.rmtree(run_dir, ignore_errors=True)
            print(f"error: {'kubectl' if kube else 'sbatch'} refused the job for {run_dir}: {e}", file=sys.stderr)
            return 2
        except BaseException:
            if created:
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
        print(
            job_id
            if kube
            else f"submitted job {job_id}: run directory {run_dir}, log {slurm.log_path(run_dir, job_id)}",
            flush=True,
        )
        say(notes)  # about the job sbatch took, not one it refused
        notes = []
    return 0


if __name__ == "__main__":
    sys.exit(main())

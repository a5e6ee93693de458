"""Golden tests of the pure command builders: nothing is launched.

Regenerate after an intended change with `UPDATE_GOLDEN=1 make test-quick` and review the diff.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest
from golden import check_golden

from launcher.launch import cli
from launcher.launch.start.argv import (
    ACCELERATE_CONFIG,
    LaunchPlan,
    accelerate_argv,
    accelerate_config_text,
    command_script,
    deepspeed_argv,
    flight_recorder_names,
    hostfile_text,
    launch_argv,
    launch_env,
    rank_env,
    sbatch_quote,
    sbatch_script,
    torchrun_argv,
)

PLAN = LaunchPlan(
    python="/opt/venv/bin/python", nproc_per_node=2, master_port=29512, threads_per_rank=1, workdir="/home/me/launcher"
)


CASES = {
    "torchrun_default.txt": ([], PLAN, "/runs/a"),
    "torchrun_restarts.txt": (["cluster.max_restarts=3", "dist.timeout_s=120"], PLAN, "/runs/b"),
    "torchrun_multinode.txt": (
        ["cluster.nnodes=2", "cluster.node_rank=1", "cluster.master_addr=10.0.0.1", "cluster.master_port=29400"],
        LaunchPlan("/opt/venv/bin/python", 8, 29400, 4, "/home/me/launcher"),
        "/runs/c",
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_torchrun_argv(name):
    overrides, plan, run_dir = CASES[name]
    cfg, _, _ = cli.compose_config(overrides)
    check_golden(name, " \\\n  ".join(torchrun_argv(cfg, run_dir, plan)) + "\n")


def test_command_script_quotes_everything():
    cfg, _, _ = cli.compose_config([])
    run_dir = "/runs/x; touch pwned $(touch pwned2) 'q'"
    script = command_script(
        torchrun_argv(cfg, run_dir, PLAN), rank_env(cfg, PLAN, run_dir), "/home/me/my repo", run_dir
    )
    check_golden("command_quoted.sh", script)
    # The exec line parses back to exactly the argv, under the supervisor: no word of it is shell syntax.
    exec_line = [line for line in script.splitlines() if line.startswith("exec ")][0]
    assert shlex.split(exec_line)[1:] == [
        PLAN.python,
        "-m",
        "launcher.launch.start.supervise",
        run_dir,
        *torchrun_argv(cfg, run_dir, PLAN),
    ]


def test_rendezvous_id_is_stable_per_run_dir():
    cfg, _, _ = cli.compose_config([])
    a = torchrun_argv(cfg, "/runs/a", PLAN)
    assert a == torchrun_argv(cfg, "/runs/a", PLAN)
    assert a != torchrun_argv(cfg, "/runs/b", PLAN)


def test_rank_env_holds_no_secrets(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "planted-secret-123")
    cfg, _, _ = cli.compose_config([])
    assert "planted-secret-123" not in str(rank_env(cfg, PLAN, "/runs/a"))


def test_the_ranks_get_the_flight_recorder_and_cluster_env_wins():
    """The collectives' flight recorder is on by default, its dump folder in the run
    directory; dist.flight_recorder=0 leaves only the size (0); a site's own setting in
    cluster.env wins over the launcher's."""
    cfg, _, _ = cli.compose_config([])
    env = rank_env(cfg, PLAN, "/runs/a")
    assert env["TORCH_FR_BUFFER_SIZE"] == "2000" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == "/runs/a/comm_trace/rank_"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    cfg, _, _ = cli.compose_config(["dist.flight_recorder=0", "+cluster.env.TORCH_NCCL_ASYNC_ERROR_HANDLING=1"])
    env = rank_env(cfg, PLAN, "/runs/a")
    assert env["TORCH_FR_BUFFER_SIZE"] == "0" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in env and "TORCH_FR_DUMP_TEMP_FILE" not in env


def test_threads_per_rank_keep_the_shells_omp_num_threads(monkeypatch):
    """Threads per rank: cluster.cpu_threads, else the OMP_NUM_THREADS the user exported
    (as torchrun keeps it), else this machine's cores / processes; into command.sh."""
    from launcher.host import HostInfo
    from launcher.launch.rundir.prepare import make_plan

    host = HostInfo(cuda=False, gpus=0, cpus=8)
    cfg, _, _ = cli.compose_config(["cluster.nproc_per_node=2"])
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert make_plan(cfg, host).threads_per_rank == 4
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    plan = make_plan(cfg, host)
    assert plan.threads_per_rank == 3 and rank_env(cfg, plan, "/runs/a")["OMP_NUM_THREADS"] == "3"
    cfg, _, _ = cli.compose_config(["cluster.nproc_per_node=2", "cluster.cpu_threads=2"])
    assert make_plan(cfg, host).threads_per_rank == 2


def test_the_flight_recorder_variables_follow_the_installed_torch(tmp_path):
    """torch 2.11 and later read TORCH_FR_*, and every process warns on stderr for the old
    names; an older site torch gets the names it reads. A gloo process of the installed torch
    given rank_env prints no such warning (the CI failure of stop 34)."""
    assert flight_recorder_names("2.13.0+cpu") == ("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE")
    assert flight_recorder_names("2.11.0a0+git1234") == ("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE")
    assert flight_recorder_names("2.6.0") == ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    cfg, _, _ = cli.compose_config([])
    env = {**os.environ, **rank_env(cfg, PLAN, str(tmp_path)), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}
    code = (
        "import torch.distributed as d, torch; d.init_process_group('gloo', rank=0, world_size=1);"
        "t = torch.ones(1); d.all_reduce(t); d.destroy_process_group(); print(int(t.item()))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "1", out.stderr
    assert "deprecated" not in out.stderr, out.stderr


def test_sbatch_script_quotes_everything():
    """A run directory and settings full of shell syntax: every value in a shell line is
    shlex-quoted, every #SBATCH value quoted the way sbatch parses it."""
    run_dir = "/runs/x; touch pwned $(touch pwned2) 'q' \"dq\""
    cfg, _, _ = cli.compose_config(
        [
            "cluster=slurm",
            "cluster.nnodes=2",
            "cluster.partition=gpu",
            "cluster.qos=low",
            "cluster.sbatch_extra=['--hold']",
        ]
    )
    cfg.cluster.env = {"NCCL_DEBUG": "INFO; touch pwned3"}
    cfg.run_name = "my 'run' \"x\""
    plan = LaunchPlan("/opt/my venv/bin/python", 2, 0, 1, "/home/me/my repo")
    script = sbatch_script(cfg, run_dir, plan)
    check_golden("sbatch_quoted.sbatch", script)
    # bash parses it; the step's inner command parses back to torchrun's argv, with the
    # per-node values left for the task's shell.
    import subprocess

    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    step = [line for line in script.replace("\\\n", " ").splitlines() if line.startswith("srun ")][0]
    words = shlex.split(step.removesuffix(" &"))
    assert words[:4] == ["srun", "--ntasks-per-node=1", "--wait=60", "bash"] and words[4] == "-c"
    inner = shlex.split(words[5].replace("\\\n", " "))
    assert inner[0] == "exec" and inner[1] == plan.python and inner[-1] == run_dir
    assert "--nnodes=$SLURM_NNODES" in inner and "--rdzv-endpoint=$HEAD_NODE:$MASTER_PORT" in inner
    assert "export NCCL_DEBUG='INFO; touch pwned3'" in script
    assert '#SBATCH --job-name="my \'run\' \\"x\\""' in script
    assert "#SBATCH --hold" in script and f"RUN_DIR={shlex.quote(run_dir)}" in script


@pytest.mark.parametrize(
    "value,quoted",
    [
        ("gpu", "gpu"),
        ("24:00:00", "24:00:00"),
        ("a b", '"a b"'),
        ('say "hi"', '"say \\"hi\\""'),
        ("back\\slash", '"back\\\\slash"'),
        ("it's", '"it\'s"'),
    ],
)
def test_sbatch_quote(value, quoted):
    assert sbatch_quote(value) == quoted


DS_CASES = {
    "deepspeed_single.txt": (["recipe=zero2", "cluster.runner=deepspeed"], PLAN, "/runs/d"),
    "deepspeed_multinode.txt": (
        [
            "recipe=zero3",
            "cluster.runner=deepspeed",
            "cluster.nnodes=2",
            "cluster.master_port=29400",
            "cluster.hosts=[node-a,node-b]",
        ],
        LaunchPlan("/opt/venv/bin/python", 8, 29400, 4, "/home/me/launcher"),
        "/runs/e",
    ),
}


@pytest.mark.parametrize("name", sorted(DS_CASES))
def test_deepspeed_argv(name):
    overrides, plan, run_dir = DS_CASES[name]
    cfg, _, _ = cli.compose_config(overrides)
    argv = deepspeed_argv(cfg, run_dir, plan)
    assert launch_argv(cfg, run_dir, plan) == argv  # cluster.runner=deepspeed picks it
    check_golden(name, " \\\n  ".join(argv) + "\n")


def test_hostfile_lists_every_node_with_its_slots():
    overrides, plan, _ = DS_CASES["deepspeed_multinode.txt"]
    cfg, _, _ = cli.compose_config(overrides)
    check_golden("hostfile_multinode.txt", hostfile_text(cfg, plan))
    assert hostfile_text(cfg, plan) == "node-a slots=8\nnode-b slots=8\n"


def test_default_runner_is_torchrun_for_every_recipe():
    for recipe in ("ddp", "zero1", "zero3_offload"):
        cfg, _, _ = cli.compose_config([f"recipe={recipe}"])
        assert launch_argv(cfg, "/runs/a", PLAN) == torchrun_argv(cfg, "/runs/a", PLAN)


def test_accelerate_argv_and_its_config_file():
    """cluster.runner=accelerate: `accelerate launch --config_file RUN_DIR/accelerate_config.yaml`
    with torchrun's options accelerate's own defaults would otherwise win over as flags, the
    rest in command.sh's environment (PET_*), after the ranks' own."""
    cfg, _, _ = cli.compose_config(["cluster.runner=accelerate", "cluster.max_restarts=2", "dist.timeout_s=120"])
    argv = accelerate_argv(cfg, "/runs/f", PLAN)
    assert launch_argv(cfg, "/runs/f", PLAN) == argv  # cluster.runner=accelerate picks it
    check_golden("accelerate_single.txt", " \\\n  ".join(argv) + "\n")
    check_golden("accelerate_config.yaml", accelerate_config_text(cfg, PLAN))
    env = launch_env(cfg, PLAN, "/runs/f")
    assert {k: v for k, v in env.items() if k.startswith("PET_")} == {
        "PET_RDZV_ENDPOINT": "127.0.0.1:29512",
        "PET_RDZV_ID": torchrun_argv(cfg, "/runs/f", PLAN)[7].split("=")[1],
        "PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        "PET_SHUTDOWN_TIMEOUT": "300",
    }
    assert rank_env(cfg, PLAN, "/runs/f").items() <= env.items()
    torchrun, _, _ = cli.compose_config([])
    assert not any(k.startswith("PET_") for k in launch_env(torchrun, PLAN, "/runs/f"))


def test_accelerate_hands_torchrun_the_launch_torchrun_gets(tmp_path, monkeypatch):
    """accelerate's own parsing of the command (its config file written, command.sh's
    environment set) up to where it calls torchrun: torchrun's launch config, ranks and module
    are those of torchrun_argv (rendezvous, restarts, signals, the time to save), and one
    machine of nproc_per_node processes. accelerate 1.15 passes rdzv_backend, rdzv_conf and
    max_restarts only from its flags (its defaults win over a config file and over PET_*)."""
    import dataclasses

    import torch.distributed.run as distrib_run
    from accelerate.commands.launch import launch_command, launch_command_parser

    cfg, _, _ = cli.compose_config(
        ["cluster.runner=accelerate", "cluster.max_restarts=2", "dist.timeout_s=120", "cluster.local_addr=10.1.2.3"]
    )
    run_dir = str(tmp_path)
    (tmp_path / ACCELERATE_CONFIG).write_text(accelerate_config_text(cfg, PLAN))
    for key, value in launch_env(cfg, PLAN, run_dir).items():
        monkeypatch.setenv(key, value)
    handed = []
    monkeypatch.setattr(distrib_run, "run", handed.append)  # where accelerate would start torchrun's agent
    argv = accelerate_argv(cfg, run_dir, PLAN)
    assert argv[:3] == [PLAN.python, "-m", "accelerate.commands.launch"]
    launch_command(launch_command_parser().parse_args(argv[3:]))
    ours, cmd, cmd_args = distrib_run.config_from_args(handed[0])
    theirs, cmd_t, cmd_args_t = distrib_run.config_from_args(
        distrib_run.parse_args(torchrun_argv(cfg, run_dir, PLAN)[3:])
    )
    assert (cmd, cmd_args) == (cmd_t, cmd_args_t) and cmd_args[-2:] == ["launcher.rank", run_dir]
    differ = {f.name for f in dataclasses.fields(ours) if getattr(ours, f.name) != getattr(theirs, f.name)}
    assert differ <= {"logs_specs"}, {k: (getattr(ours, k), getattr(theirs, k)) for k in differ}  # a fresh object each
    assert (ours.nproc_per_node, ours.max_nodes, ours.max_restarts, ours.rdzv_backend) == (2, 1, 2, "c10d")
    assert ours.rdzv_configs["join_timeout"] == "120" and ours.local_addr == "10.1.2.3"
    assert "SIGUSR1" in ours.signals_to_handle and ours.shutdown_timeout == 300


def test_dry_run_of_accelerate_prints_its_config_and_command(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    assert cli.main(["train", "cluster.runner=accelerate", f"hydra.run.dir={run}", "--dry-run"]) == 0
    out = capsys.readouterr().out
    config = out.split(f"# {ACCELERATE_CONFIG}\n", 1)[1].split("# command\n")[0]
    assert "distributed_type: MULTI_GPU" in config and "num_processes: 2" in config
    exec_line = [line for line in out.splitlines() if line.startswith("exec ")][0]
    words = shlex.split(exec_line)  # exec PYTHON -m launcher.launch.start.supervise RUN PYTHON -m accelerate...
    assert words[3:5] == ["launcher.launch.start.supervise", str(run)]
    assert words[7:10] == [
        "accelerate.commands.launch",
        f"--config_file={run}/{ACCELERATE_CONFIG}",
        "--rdzv_backend=c10d",
    ]
    assert "export PET_RDZV_ENDPOINT=127.0.0.1:" in out and not run.exists()


def test_torchrun_options_follow_the_installed_torchrun(monkeypatch):
    """torch 2.13's torchrun takes --shutdown-timeout; a site's torch 2.11 (seen on the H200,
    bench/gpu.md) refuses it and every launch failed: the option is left out there."""
    from launcher.launch.start import argv as commands

    assert commands.torchrun_takes("--shutdown-timeout") and not commands.torchrun_takes("--no-such-option")
    cfg, _, _ = cli.compose_config([])
    assert "--shutdown-timeout=300" in torchrun_argv(cfg, "/runs/a", PLAN)
    monkeypatch.setattr(commands, "torchrun_takes", lambda option: option != "--shutdown-timeout")
    argv = torchrun_argv(cfg, "/runs/a", PLAN)
    assert not any(a.startswith("--shutdown-timeout") for a in argv) and "--max-restarts=0" in argv


@pytest.mark.parametrize(
    "command,flags",
    [
        ("train", ["--dry-run", "--multirun"]),
        ("submit", ["--dry-run"]),
        ("plan", ["--json"]),
        ("rehearse", ["--ranks", "--json"]),
        ("export", ["RUN_DIR"]),
        ("data", []),
    ],
)
def test_each_command_prints_its_own_flags_and_runs_nothing(command, flags, tmp_path, capsys, monkeypatch):
    """`launcher COMMAND --help` (or -h, anywhere on the line): the command's flags and what
    it does, exit 0, nothing composed or written; `launcher --help` names every command."""
    monkeypatch.chdir(tmp_path)
    assert cli.main([command, "model=gpt_small", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: launcher {command} [-h]") and all(f in out for f in flags), out
    assert cli.main([command, "-h"]) == 0 and capsys.readouterr().out == out
    assert list(tmp_path.iterdir()) == []  # no run directory, no outputs/
    assert cli.main(["--help"]) == 0
    assert f"launcher {command} " in capsys.readouterr().out

"""End to end: real torchrun, 2 gloo processes, the tiny model, real W&B offline files."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import wandb_file
from runs import REPO, assert_same_training, here, in_fp32, launch, read_metrics, token_file

from launcher import config as C
from launcher.launch import cli
from launcher.manifest import verify
from launcher.rank.metrics import STEP_METRICS

pytestmark = pytest.mark.slow


def test_default_run_learns_logs_and_checkpoints(run_dir):
    """The default run for 60 steps: it learns, logs and checkpoints. In the precision a user
    gets on this machine: fp32 on a CPU without native bf16 (this one's and CI's; bf16 there
    is emulated, 8x slower, and checked where bf16 is the point: test_zero, test_parallel_train)."""
    proc = launch(
        "train.steps=60",
        "optim.warmup_steps=6",
        "logger.log_every=1",
        "logger.mode=offline",
        "logger.system_metrics_s=2",
        "checkpoint.every=30",
        "debug.final_digest=true",
        run_dir=run_dir,
        timeout=600,
    )
    assert f"run directory: {run_dir}" in proc.stdout

    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 61))
    for row in rows:
        for name in STEP_METRICS:
            assert isinstance(row[name], (int, float)), f"{name} missing or not a number in {row}"
        assert "mfu" not in row  # a CPU has no known peak FLOP/s: no MFU rather than a wrong one (issue 48)
    assert rows[-1]["loss"] < 0.55 * rows[0]["loss"], (rows[0]["loss"], rows[-1]["loss"])  # 0.51 at step 60
    # 16Ψ for mixed-precision Adam (fp32 params 4Ψ, grads 4Ψ, moments 8Ψ), plus Adam's
    # 4-byte step counter on each of the 38 parameter tensors.
    assert all(r["mem/model_state_bytes"] == 16 * 885_888 + 4 * 38 for r in rows)
    assert rows[-1]["mem/params_bytes"] == rows[-1]["mem/grads_bytes"] == 4 * 885_888

    summary = json.loads((run_dir / "summary.json").read_text())
    digests = summary["weights_digest_per_rank"]  # debug.final_digest: off unless asked (it reads every weight)
    assert len(digests) == 2 and digests[0] == digests[1], "ranks ended with different weights"
    assert summary["final_loss"] > summary["loss_floor"] > 1.0

    # The run directory: frozen config, the exact command, checkpoints behind `latest`.
    frozen = C.load_frozen(run_dir)
    assert frozen.train.steps == 60 and frozen.recipe.name == "ddp" and frozen.precision.name == "fp32"
    assert str(run_dir) in (run_dir / "command.sh").read_text()
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text().splitlines()[0] == "step_00000060"
    for step in (30, 60):
        assert verify(ckpts / f"step_{step:08d}") is None
    state = torch.load(ckpts / "step_00000060" / "engine" / "model.pt", weights_only=True)
    assert state["tok_embeddings.weight"].shape == (256, 128)

    # W&B: one offline run whose history holds the same numbers as metrics.jsonl.
    runs = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    info = wandb_file.run_info(runs[0])
    assert info["id"] == (run_dir / "wandb_id").read_text().strip()
    assert info["config"]["train"]["steps"] == 60
    history = {h["_step"]: h for h in wandb_file.history(runs[0])}
    assert sorted(history) == list(range(1, 61))
    for row in rows:
        logged = history[row["step"]]
        for name in ("loss", "tokens_per_s", "mem/peak_bytes", "mem/model_state_bytes"):
            assert logged[name] == pytest.approx(row[name], rel=1e-12), name

    # Start-up per rank in summary.json; the worst rank in W&B's summary and on the console.
    startup = summary["startup"]
    assert len(startup["host_peak_bytes"]) == 2 and startup["device_peak_bytes"] == [None, None]
    for peak, base, built in zip(
        startup["host_peak_bytes"], startup["host_base_bytes"], startup["host_built_peak_bytes"]
    ):
        assert peak >= built >= base > 0
    assert all(0 < s < 120 for s in startup["seconds"])
    # Provenance: this launch's command, commit and packages; the ranks' hosts and the code
    # they imported; the commit again in W&B's config.
    rec = json.loads((run_dir / "provenance.json").read_text())
    assert rec["argv"][0] == "train" and "train.steps=60" in rec["argv"] and rec["node_rank"] == 0
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    hosts = json.loads((run_dir / "provenance" / "hosts.jsonl").read_text())
    if head.returncode == 0:  # a checkout (CI's clean clone is one); the ranks record the code they ran
        assert rec["git"]["commit"] == hosts["git"]["commit"] == head.stdout.strip()
    assert f"torch=={rec['versions']['torch']}" in (run_dir / rec["folder"] / "requirements.txt").read_text().split()
    assert hosts["hosts"] == {socket.gethostname(): [0, 1]} and Path(hosts["code"]) == REPO
    assert info["config"]["provenance"]["commit"] == rec["git"].get("commit")
    assert info["config"]["provenance"]["rank_hosts"] == hosts["hosts"]
    # W&B's system monitor sampled rank 0's node (on a GPU node also gpu.<i>.* per GPU).
    samples = wandb_file.stats(runs[0])
    assert len(samples) >= 2 and all("memory_percent" in s and "proc.memory.rssMB" in s for s in samples)
    in_wandb = wandb_file.summary(runs[0])
    assert in_wandb["startup/host_peak_bytes"] == max(startup["host_peak_bytes"])
    assert in_wandb["startup/seconds"] == max(startup["seconds"])
    assert "startup/host_peak_bytes" in proc.stdout


RESUMED = ["train.steps=20", "optim.warmup_steps=4", "logger=none", "logger.log_every=1", "checkpoint.every=10"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """20 steps without a stop: what the resumed run must equal, and what the export reads."""
    run = tmp_path_factory.mktemp("straight") / "run"
    launch(*RESUMED, run_dir=run)
    return run


def test_resume_continues_bit_identically(straight, tmp_path):
    common, split = RESUMED, tmp_path / "split"
    # The split run also logs to W&B (offline): the resumed launch must continue that run.
    wandb_on = ["logger=wandb", "logger.mode=offline", "logger.system_metrics_s=0"]  # and no system monitor
    launch(*common, *wandb_on, "train.stop_at=10", run_dir=split)
    assert (split / "checkpoints" / "latest").read_text().splitlines()[0] == "step_00000010"
    assert not (split / "checkpoints" / "step_00000020").exists()
    # A run directory written before recipe.strategy was renamed recipe.engine resumes (C.RENAMED).
    frozen = split / "config.yaml"
    frozen.write_text(frozen.read_text().replace("  engine: ddp\n", "  strategy: ddp\n"))
    assert "  strategy: ddp\n" in frozen.read_text()
    # RUN_DIR/command.sh, run again, resumes (its config.yaml still says stop_at=10).
    proc = subprocess.run(["bash", str(split / "command.sh")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "at step 10" in proc.stdout
    assert "train.stop_at=10 is behind the checkpoint (step 10): training on to train.steps=20" in proc.stdout

    runs = sorted((split / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 2 and len({wandb_file.run_info(r)["id"] for r in runs}) == 1, "resume started a new W&B run"
    assert [h["_step"] for h in wandb_file.history(runs[1])] == list(range(11, 21))
    assert not any(wandb_file.stats(r) for r in runs), "logger.system_metrics_s=0 still sampled"

    assert_same_training(straight, split, 20)
    # Not asked for (debug.final_digest): the run ends without reading every weight.
    assert json.loads((straight / "summary.json").read_text())["weights_digest_per_rank"] is None
    oa = torch.load(straight / "checkpoints/step_00000020/engine/optim.pt", weights_only=True)
    ob = torch.load(split / "checkpoints/step_00000020/engine/optim.pt", weights_only=True)
    for pid, st in oa["optimizer"]["state"].items():
        assert torch.equal(st["exp_avg_sq"], ob["optimizer"]["state"][pid]["exp_avg_sq"])


def test_accelerate_launch_trains_as_torchrun_and_stops_and_resumes(straight, tmp_path):
    """cluster.runner=accelerate: the same 20 steps as torchrun's (losses, gradient norms and
    the last weights identical), through a SIGTERM (exit 75 from the rank's marker, the step
    saved) and a resume by RUN_DIR/command.sh alone, its accelerate config in the run
    directory; accelerate's default config (~/.cache/huggingface/accelerate, here one that
    would start 7 processes under mpirun) is never read. Rank 0 is slowed from step 4 (a
    sleep, the numbers unchanged) so the stop lands well before step 20."""
    import signal

    from runs import start, wait_for_step

    hf_home = tmp_path / "hf"
    (hf_home / "accelerate").mkdir(parents=True)
    default = "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: 7\nuse_cpu: true\n"
    (hf_home / "accelerate" / "default_config.yaml").write_text(default)
    run, env = tmp_path / "acc", {"HF_HOME": str(hf_home)}
    proc = start(
        run,
        *RESUMED,
        "cluster.runner=accelerate",
        "debug.fault=slow",
        "debug.fault_step=4",
        "debug.fault_steps=9",
        "debug.slow_s=0.25",
        env=env,
    )
    wait_for_step(run, 3, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, out[-3000:]
    step = json.loads((run / "preempted.json").read_text())["step"]
    assert 3 <= step < 20 and f"preempted by SIGTERM after step {step}" in out
    assert "distributed_type: MULTI_GPU" in (run / "accelerate_config.yaml").read_text()
    script = (run / "command.sh").read_text()
    assert f"-m accelerate.commands.launch --config_file={run}/accelerate_config.yaml" in script
    resumed = subprocess.run(
        ["bash", str(run / "command.sh")], capture_output=True, text=True, timeout=300, env={**os.environ, **env}
    )
    assert resumed.returncode == 0 and f"at step {step}" in resumed.stdout, resumed.stderr[-3000:]
    assert_same_training(straight, run, 20)
    assert [p.name for p in (hf_home / "accelerate").iterdir()] == ["default_config.yaml"]
    assert (hf_home / "accelerate" / "default_config.yaml").read_text() == default


def test_rank_entry_by_hand_with_a_token_file(tmp_path):
    """`python -m launcher.rank RUN_DIR/config.yaml` without the launcher: one process."""
    tokens = token_file(tmp_path, "the quick brown fox jumps over the lazy dog. " * 400)
    cfg, _, _ = cli.compose_config(
        [
            "data=memmap",
            f"data.path={tokens}",
            "precision=fp32",
            "train.steps=30",
            "optim.warmup_steps=3",
            "logger=none",
            "logger.log_every=5",
            "train.micro_batch=4",
        ]
    )
    run = tmp_path / "byhand"
    run.mkdir()
    (run / "config.yaml").write_text(C.to_yaml(cfg))
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.rank", str(run / "config.yaml")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [5, 10, 15, 20, 25, 30]
    assert rows[-1]["loss"] < 0.6 * rows[0]["loss"]  # English bytes: learnable fast
    assert (run / "checkpoints" / "step_00000030" / "manifest.json").exists()


def dry(*overrides: str, capsys) -> tuple[int, str, str]:
    """`launcher train ARGS` by the launcher's own main in this process (a dry run starts no
    process to watch; a new interpreter would only add its imports): code, stdout, stderr."""
    code = cli.main(["train", *in_fp32(overrides)])
    out, err = capsys.readouterr()
    return code, out, err


def test_dry_run_prints_and_starts_nothing(run_dir, capsys):
    code, out, _ = dry("--dry-run", "model=gpt_small", f"hydra.run.dir={run_dir}", capsys=capsys)
    assert code == 0 and "name: gpt_small" in out and "torch.distributed.run" in out
    assert not run_dir.exists()
    assert "\ndry_run:" not in out  # a flag, never a key of config.yaml
    code, _, err = dry("dry_run=true", f"hydra.run.dir={run_dir}", capsys=capsys)
    assert code == 2 and "dry_run" in err and not run_dir.exists()
    code, _, err = dry("--json", f"hydra.run.dir={run_dir}", capsys=capsys)  # plan's flag, not train's
    assert code == 2 and err.strip().splitlines() == [
        "error: unknown flag '--json' for train; allowed: --dry-run, -m/--multirun, -h/--help, or key=value overrides"
    ]


def test_multirun_makes_one_run_dir_per_point(tmp_path, capsys):
    code, out, _ = dry("-m", "optim.lr=1e-3,2e-3", "--dry-run", f"hydra.sweep.dir={tmp_path / 'sweep'}", capsys=capsys)
    assert code == 0 and out.count("lr: 0.001") == 1 and out.count("lr: 0.002") == 1
    assert f"{tmp_path / 'sweep'}/0" in out and f"{tmp_path / 'sweep'}/1" in out


def test_a_sweep_keeps_its_points_in_one_folder(tmp_path, capsys, monkeypatch):
    """The default sweep folder names the time: resolved once, not per point (a clock that
    moves on between points used to scatter them over several folders)."""
    from omegaconf import OmegaConf

    ticks = iter(range(100))
    OmegaConf.register_new_resolver("now", lambda pattern: f"t{next(ticks)}", replace=True)
    monkeypatch.chdir(tmp_path)
    try:
        assert cli.main(["train", "-m", "optim.lr=1e-3,2e-3,3e-3", "--dry-run"]) == 0
    finally:
        from datetime import datetime

        OmegaConf.register_new_resolver("now", lambda pattern: datetime.now().strftime(pattern), replace=True)
    lead = "# The exact command that trains "
    dirs = {line[len(lead) :].rstrip(".") for line in capsys.readouterr().out.splitlines() if line.startswith(lead)}
    parents = {str(Path(d).parent) for d in dirs}
    assert len(dirs) == 3 and len(parents) == 1, dirs


def test_a_sweep_names_its_points_and_compares_them_at_the_end(tmp_path):
    """`make train ARGS="-m optim.lr=1e-3,2e-3"`, 2 points of 2 steps (the one launch this
    needs): its points were `run 0` and `run 1`, with no value shown and nothing to compare
    them by at the end; the CPU summary also showed `startup/device_peak_bytes` as None."""
    sweep = tmp_path / "sweep"
    out = launch(
        "-m",
        "optim.lr=1e-3,2e-3",
        f"hydra.sweep.dir={sweep}",
        "train.steps=2",
        "optim.warmup_steps=0",
        "logger=none",
        "train.eval_every=2",
    ).stdout
    for i, name in enumerate(("optim.lr=0.001", "optim.lr=0.002")):
        assert f"sweep point {i + 1}/2: {name}\nrun directory: {sweep / str(i)}\n" in out, out[-3000:]
        assert f" run {name} " in out and f" run {i} " not in out
    assert "None" not in out, out[-3000:]
    table = out[out.index(f"sweep: 2 points in {sweep}") :].splitlines()
    assert [c.strip() for c in table[2].split("┃")[1:-1]] == [
        "point",
        "run",
        "exit",
        "final loss",
        "val loss",
        "tokens/s",
        "peak memory",
    ], table
    for i, name in enumerate(("optim.lr=0.001", "optim.lr=0.002")):
        s = json.loads((sweep / str(i) / "summary.json").read_text())
        row = [c.strip() for c in table[4 + i].split("│")[1:-1]]
        assert row == [
            name,
            str(i),
            "ok",
            f"{s['final_loss']:.4f}",
            f"{s['val_loss']:.4f}",
            f"{s['tokens_per_s']:,.0f}",
            f"{s['peak_mem_bytes'] / 2**20:,.0f} MiB",
        ], table


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_export_loads_into_the_model_with_the_same_logits(straight):
    from launcher.launch.commands.export import load_exported
    from launcher.models.gpt import GPT

    run = straight
    path = run / "export" / "step_00000020" / "model.safetensors"
    assert str(path) in here("export", str(run)).stdout
    exported = load_exported(path)
    trained = GPT(C.load_frozen(run).model)
    trained.load_state_dict(torch.load(run / "checkpoints/step_00000020/engine/model.pt", weights_only=True))
    x = torch.randint(0, 256, (2, 64))
    with torch.no_grad():
        assert torch.equal(exported(x), trained(x))
    fp32_bytes = path.read_bytes()
    out = here("export", str(run), "export.dtype=bf16").stdout  # beside the fp32 export, not over it
    half_path = run / "export" / "step_00000020-bf16" / "model.safetensors"
    assert f"exported {half_path} (bf16)" in out and path.read_bytes() == fp32_bytes
    assert {oct(p.stat().st_mode & 0o777) for p in (path, half_path)} == {oct(0o666 & ~_umask())}
    half = load_exported(half_path)
    with torch.no_grad():
        assert torch.allclose(half(x), trained(x), atol=0.05)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (fp16's loss scaler)")
@pytest.mark.parametrize("recipe", ["ddp", "zero2"])
def test_fp16_overflow_steps_are_counted(recipe, tmp_path):
    """A loss scale far too large (2^40) makes the first steps overflow: each is skipped and
    halves the scale; metrics.jsonl and summary.json count them (`skipped_steps`)."""
    run = tmp_path / "run"
    launch(
        f"recipe={recipe}",
        "precision=fp16",
        "precision.initial_scale=1099511627776",
        "cluster.nproc_per_node=1",
        "train.steps=30",
        "optim.warmup_steps=2",
        "logger=none",
        "logger.log_every=1",
        run_dir=run,
    )
    rows = read_metrics(run)
    counts = [r["skipped_steps"] for r in rows]
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] < 30, counts
    assert rows[-1]["loss_scale"] < 2**40
    assert json.loads((run / "summary.json").read_text())["skipped_steps"] == counts[-1]

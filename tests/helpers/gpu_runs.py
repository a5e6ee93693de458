"""What the GPU tests (tests/gpu) share: launcher runs started together as far as the GPUs'
memory holds them, their exit codes, and the measurements make gpu-check writes to
bench/gpu.md (GPU_CHECK_OUT/<name>.json; scripts/gpu_report.py renders their "table")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from runs import REPO

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def start(run: Path, overrides: list[str], log: Path | None = None) -> subprocess.Popen:
    log = open(log or run.with_suffix(".log"), "w")
    return subprocess.Popen(
        [sys.executable, "-m", "launcher", "train", f"hydra.run.dir={run}", *overrides],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def plan_row(overrides: list[str], world: int | None = None):
    """The planner's row for a run's overrides at its world size (this machine's GPUs by default)."""
    from launcher.launch import cli
    from launcher.planner import plan as planner

    cfg, _, _ = cli.compose_config(overrides)
    cfg = planner.planned_model(cfg)
    return planner.memory_row(
        cfg, planner.layout_for(cfg, world or GPUS), cfg.train.activation_checkpointing, cfg.train.micro_batch
    )


def footprint(overrides: list[str]) -> int:
    """Bytes a case may take on each GPU: the planner's peak per rank with room for what the
    plan does not count (the allocator's cache and fragmentation, compile's workspace), plus
    each process's CUDA context and NCCL buffers. 0 for a case the launcher refuses."""
    from launcher.config import ConfigError

    try:
        row = plan_row(overrides)
    except (ConfigError, SystemExit):
        return 0
    return int(1.3 * row.peak) + 2 * 2**30


def schedule(todo: dict[str, list[str]], start, budget: int, deadline: float) -> dict[str, int]:
    """Start the cases in order while their footprints fit in `budget` bytes per GPU beside
    those running; wait for one to end when the next does not fit. {name: exit code}."""
    need = {name: min(footprint(over), budget) for name, over in todo.items()}
    waiting, running, codes = list(todo), {}, {}
    while waiting or running:
        while waiting and sum(need[n] for n in running) + need[waiting[0]] <= budget:
            name = waiting.pop(0)
            running[name] = start(name, todo[name])
        for name, proc in list(running.items()):
            if proc.poll() is not None:
                codes[name] = running.pop(name).returncode
            elif time.time() > deadline:
                proc.kill()
                codes[name] = running.pop(name).wait()
        time.sleep(0.5)
    return codes


def together(root: Path, todo: dict[str, list[str]], seconds: float = 900) -> dict[str, tuple[Path, int]]:
    """The runs started together as far as 90% of the GPUs' memory holds them. {name: (run dir, exit code)}."""
    budget = int(0.9 * min(torch.cuda.get_device_properties(i).total_memory for i in range(GPUS)))
    codes = schedule(todo, lambda name, over: start(root / name, over), budget, time.time() + seconds)
    return {name: (root / name, code) for name, code in codes.items()}


def ended(proc: subprocess.Popen, timeout: float = 600) -> int:
    """Its exit code; killed (and said so by the code) when it outlasts `timeout`."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def chosen(todo: dict[str, list[str]], prefixes: str) -> dict[str, list[str]]:
    """The cases whose names start with one of the comma-separated `prefixes` (GPU_CASES,
    to spend a short GPU loan on part of the set, e.g. "plan-"); all of them when empty."""
    wanted = tuple(p.strip() for p in prefixes.split(",") if p.strip())
    return {name: over for name, over in todo.items() if not wanted or name.startswith(wanted)}


def ran(runs, name: str) -> tuple[Path, int]:
    """(run dir, exit code) of a case; the test is skipped when GPU_CASES left the case out."""
    if name not in runs:
        pytest.skip(f"{name} was not run (GPU_CASES={os.environ.get('GPU_CASES', '')})")
    return runs[name]


def log_of(run: Path, name: str) -> str:
    log = run.parent / f"{name}.log"
    return log.read_text() if log.exists() else ""


def finished(runs, name: str) -> Path:
    run, code = ran(runs, name)
    assert code == 0, f"{name} exited {code}\n{log_of(run, name)[-6000:]}"
    return run


def record(name: str, data: dict) -> None:
    """A measurement for make gpu-check's bench/gpu.md (GPU_CHECK_OUT/<name>.json)."""
    folder = os.environ.get("GPU_CHECK_OUT")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")


def gib(n) -> str:
    return f"{n / 2**30:.2f}" if n else "n/a"


def save_llama(folder: Path, shape: dict, dtype: torch.dtype, head_scale: float = 1.0, **save) -> Path:
    """A Llama of `shape` with random weights (built on the GPU: seconds, not the CPU's
    minute at 1B), its head scaled by `head_scale`, written by save_pretrained in `dtype`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**shape)).to(dtype)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    model.save_pretrained(folder, **save)
    del model
    torch.cuda.empty_cache()
    return folder

"""Launch the real launcher in a subprocess, read what a run left: the helpers the tests share."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Fast, quiet runs: the tiny model, few steps, W&B offline (never online from a test).
FAST = ["train.steps=12", "optim.warmup_steps=2", "logger.log_every=1", "logger.mode=offline"]


def in_fp32(overrides) -> list[str]:
    """`precision=fp32` ahead of `overrides` unless they choose a precision. The project's
    default, bf16, is emulated on a CPU without native bf16 (AVX-512 BF16/AMX), this
    machine's and CI's: a step of the tiny model takes 8x as long as in fp32. A test runs
    bf16 where bf16 is what it checks, and says so with `precision=bf16`."""
    overrides = list(overrides)
    return (
        overrides
        if any(o.startswith(("precision=", "+precision=")) for o in overrides)
        else ["precision=fp32", *overrides]
    )


def launch(
    *overrides: str,
    run_dir: Path | None = None,
    command: str = "train",
    timeout: int = 300,
    env: dict | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """`python -m launcher train [hydra.run.dir=RUN] overrides...`, as a user types it
    (`env` adds to this process's environment; a None value removes the variable)."""
    argv = [sys.executable, "-m", "launcher", command]
    if run_dir is not None:
        argv.append(f"hydra.run.dir={run_dir}")
    argv += in_fp32(overrides) if command in ("train", "submit") else list(overrides)
    full_env = {k: v for k, v in {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}.items() if v is not None}
    try:
        proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=full_env)
    except subprocess.TimeoutExpired as e:  # say where the run was: the last lines, not a truncated repr
        out, err = (x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr))
        raise AssertionError(
            f"{' '.join(argv)} still running after {timeout} s\n--- stdout\n{out[-4000:]}\n--- stderr\n{err[-6000:]}"
        ) from None
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(argv)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
            f"\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def here(command: str, *args: str) -> subprocess.CompletedProcess:
    """`launcher COMMAND args...` (plan, export) run in this process, as `launch` runs it in
    a new one but without an interpreter to start: what it printed; a non-zero exit fails."""
    import io

    from launcher.launch import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main([command, *args])
    assert rc == 0, (
        f"launcher {command} {' '.join(args)} exited {rc}\n{out.getvalue()[-3000:]}\n{err.getvalue()[-4000:]}"
    )
    return subprocess.CompletedProcess(["launcher", command, *args], rc, out.getvalue(), err.getvalue())


def start(run_dir: Path, *overrides: str, env: dict | None = None, split_stderr: bool = False) -> subprocess.Popen:
    """`python -m launcher train ...` in the background (to signal or kill it while it
    trains). stderr joins stdout unless split_stderr (to check what went to which)."""
    argv = [sys.executable, "-m", "launcher", "train", f"hydra.run.dir={run_dir}", *in_fp32(overrides)]
    return subprocess.Popen(
        argv,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE if split_stderr else subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Until metrics.jsonl has `step` rows (the run logs every step)."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        path = run_dir / "metrics.jsonl"
        if path.exists() and len(path.read_text().splitlines()) >= step:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    raise AssertionError(f"no step {step} within {timeout}s")


def processes_of(run_dir: Path) -> list[int]:
    """Pids whose command line names the run directory (the launcher, torchrun, the ranks)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if str(run_dir).encode() in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


def rank_process(run_dir: Path, rank: int):
    """The psutil.Process of rank `rank` of the run in `run_dir` (not torchrun's), or None
    while there is none."""
    import psutil

    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "launcher.rank" in cmd and str(run_dir) in cmd and "torch.distributed.run" not in cmd:
            with contextlib.suppress(psutil.Error):
                if p.environ().get("RANK") == str(rank):
                    return p
    return None


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def evaluated(run_dir: Path) -> dict[int, float]:
    """train.eval_every's val/loss by step; no step evaluated twice (a resumed run evaluates
    on from its checkpoint) and val/perplexity its exp."""
    import math

    rows = [r for r in read_metrics(run_dir) if "val/loss" in r]
    assert len({r["step"] for r in rows}) == len(rows), f"a step evaluated twice: {[r['step'] for r in rows]}"
    assert all(abs(r["val/perplexity"] / math.exp(r["val/loss"]) - 1) < 1e-9 for r in rows), rows
    return {r["step"]: r["val/loss"] for r in rows}


def assert_same_training(a: Path, b: Path, steps: int) -> None:
    """Two runs trained identically: the same loss and gradient norm at every step (exactly)
    and the same weights in the last checkpoint."""
    import torch

    ra, rb = read_metrics(a), read_metrics(b)
    assert [r["step"] for r in rb] == list(range(1, steps + 1))
    assert [r["loss"] for r in ra] == [r["loss"] for r in rb]  # exact, every step
    assert [r["grad_norm"] for r in ra] == [r["grad_norm"] for r in rb]
    last = f"checkpoints/step_{steps:08d}/engine/model.pt"
    wa, wb = torch.load(a / last, weights_only=True), torch.load(b / last, weights_only=True)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def token_file(folder: Path, text: str) -> Path:
    """A token file made from `text` by scripts/prepare_data.py, as a user makes one."""
    src, out = folder / "corpus.txt", folder / "corpus.bin"
    src.write_text(text)
    subprocess.run(
        [sys.executable, "scripts/prepare_data.py", "--input", str(src), "--output", str(out)],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    return out


def assert_refused(code: int, out: str, err: str, words: list[str]) -> None:
    """Bad input as the launcher answers it: exit 2, one line `error: ...` holding `words`."""
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for w in words:
        assert w in lines[0], (w, lines[0])

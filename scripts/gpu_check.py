#!/usr/bin/env python
"""`make gpu-check`: on a machine with CUDA GPUs, the GPU test set (`pytest -m gpu`) and the
GPU benchmark, written to bench/gpu.md with the machine's facts (GPU name and count, driver,
CUDA, torch, NCCL and DeepSpeed versions, date). Without a GPU it says so in one line and
exits 0 having run nothing.

The benchmark: tokens/s, MFU and peak memory of ddp, fsdp, zero2 and zero3 (and tp, pp on
2+ GPUs, beside ddp) on gpt_1b and gpt_350m at seq 2048 in bf16, each beside its
hand-written loop (scripts/bench_*_baseline.py) on the same model, batch and precision,
eager and with torch.compile (ddp and fsdp). Each case runs alone on the GPUs. Cases run
in the order below until --budget-s is spent; those left out are listed as not run.

    make gpu-check                       # everything
    make gpu-check ARGS="--budget-s 300 --no-tests"
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

SEQ = 2048
# (model, recipe, compile), in the order they run: the MFU target first.
CASES = [("gpt_1b", "fsdp", True), ("gpt_1b", "fsdp", False), ("gpt_1b", "ddp", False), ("gpt_1b", "ddp", True),
         ("gpt_1b", "zero2", False), ("gpt_1b", "zero3", False),
         ("gpt_350m", "fsdp", False), ("gpt_350m", "ddp", False), ("gpt_350m", "zero2", False),
         ("gpt_350m", "zero3", False), ("gpt_350m", "fsdp", True), ("gpt_350m", "ddp", True)]
MICRO_BATCH = {"gpt_1b": 4, "gpt_350m": 8}
# gpt_350m stops at 1024 positions (GPT-2 medium's); its positions are rotary, so 2048 adds no parameter.
AT_SEQ = {"gpt_1b": ["model=gpt_1b"], "gpt_350m": ["model=gpt_350m", f"model.max_seq_len={SEQ}"]}


def facts() -> dict:
    import torch

    driver = "unknown"
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)
        driver = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else driver
    try:
        from importlib.metadata import version

        deepspeed = version("deepspeed")
    except Exception:
        deepspeed = "not installed"
    nccl = torch.cuda.nccl.version()
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "gpu": torch.cuda.get_device_name(0), "count": torch.cuda.device_count(),
            "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
            "driver": driver, "cuda": torch.version.cuda, "torch": torch.__version__,
            "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
            "deepspeed": deepspeed, "python": platform.python_version(), "cpus": len(os.sched_getaffinity(0))}


def run_tests(out: Path) -> dict:
    """pytest -m gpu tests/gpu; {test id: outcome (+ reason)} and the wall seconds."""
    junit = out / "junit.xml"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu", f"--junitxml={junit}",
                           "-p", "no:cacheprovider"], cwd=REPO, text=True, capture_output=True,
                          env={**os.environ, "GPU_CHECK_OUT": str(out / "measured")})
    wall = time.perf_counter() - t0
    print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n", flush=True)
    results = {}
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            name = case.get("name")
            outcome, why, tail = "passed", "", ""
            for tag in ("failure", "error", "skipped"):
                node = case.find(tag)
                if node is not None:
                    outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[tag]
                    why = (node.get("message") or "").splitlines()[0][:200] if node.get("message") else ""
                    tail = "\n".join((node.text or "").strip().splitlines()[-15:]) if tag != "skipped" else ""
            results[name] = {"outcome": outcome, "why": why, "tail": tail}
    return {"results": results, "wall_s": wall, "returncode": proc.returncode}


def chosen(spec: str | None) -> list[tuple]:
    """--cases "gpt_1b:ddp,gpt_350m:fsdp:compile": those cases of CASES, in that order."""
    if not spec:
        return CASES
    picked = []
    for item in spec.split(","):
        model, recipe, *flag = item.strip().split(":")
        case = (model, recipe, flag == ["compile"])
        if case not in CASES or flag not in ([], ["compile"]):
            print(f"gpu-check: --cases {item!r} is not a bench case; the cases are "
                  + ", ".join(f"{m}:{r}{':compile' if c else ''}" for m, r, c in CASES), file=sys.stderr)
            raise SystemExit(2)
        picked.append(case)
    return picked


def run_bench(out: Path, budget_s: float, steps: int, cases: list[tuple] = CASES,
              progress=lambda rows, left: None) -> tuple[list[dict], list[tuple]]:
    """The cases in order until the budget is spent: (rows, cases not run). `progress(rows,
    cases left)` after each case (bench/gpu.md is rewritten as it goes)."""
    import torch

    import bench as bench_script
    from bench import Bench
    from launcher.device import peak_flops
    from launcher.launch import cli
    from launcher.models import flops_per_token

    gpus = torch.cuda.device_count()
    bench_script.MODELS.update(AT_SEQ)  # the bench's model names: these overrides on both sides
    rows, left, t0 = [], [], time.perf_counter()
    for model, recipe, compiled in cases:
        spent = time.perf_counter() - t0
        per_case = spent / len(rows) if rows else 60.0
        if spent + per_case > budget_s:
            left.append((model, recipe, compiled))
            continue
        args = argparse.Namespace(nproc=gpus, dtype="bf16", steps=steps, micro_batch=MICRO_BATCH[model], seq_len=SEQ)
        bench = Bench(args)
        bench.runs = out / "runs"
        bench.runs.mkdir(parents=True, exist_ok=True)
        extra = ["train.compile=true"] if compiled else []
        row = {"model": model, "recipe": recipe, "compile": compiled, "micro_batch": args.micro_batch, "seq": SEQ}
        try:
            ours = bench.recipe(recipe, model, extra)
            theirs, _ = bench.baseline(recipe, model, warmup=5, more=("--compile",) if compiled else ())
        except SystemExit as err:  # a failed run: its output, and on to the next case
            row["error"] = str(err)[-1500:]
            rows.append(row)
            progress(rows, left)
            print(f"bench {model} {recipe} compile={compiled}: FAILED\n{row['error']}", flush=True)
            continue
        cfg, _, _ = cli.compose_config([*AT_SEQ[model], f"train.seq_len={SEQ}"])
        fpt = flops_per_token(cfg, SEQ)
        peak, _ = peak_flops(torch.device("cuda", 0), torch.bfloat16)
        summary = json.loads((bench.runs / f"{recipe}-{model}" / "summary.json").read_text())
        row |= {"tokens_per_s": ours["tokens_per_s"], "baseline_tokens_per_s": theirs["tokens_per_s"],
                "ratio": ours["tokens_per_s"] / theirs["tokens_per_s"],
                "mfu": ours["tokens_per_s"] * fpt / (peak * gpus), "mfu_logged": summary["mfu"],
                "baseline_mfu": theirs["tokens_per_s"] * fpt / (peak * gpus),
                "peak_bytes": ours["peak_bytes"], "baseline_peak_bytes": theirs["peak_bytes"]}
        rows.append(row)
        progress(rows, left)
        print(f"bench {model} {recipe} compile={compiled}: {row['tokens_per_s']:,.0f} vs "
              f"{row['baseline_tokens_per_s']:,.0f} tok/s ({row['ratio']:.3f}x), MFU {100 * row['mfu']:.1f}%", flush=True)
    return rows, left


def error_line(text: str) -> str:
    """The line that names the failure (the last `SomethingError: ...`), else the last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip() and not set(line.strip()) <= set("=-^")]
    named = [line for line in lines if re.match(r"[\w.]+(Error|Exception)\b", line) or line.startswith("error:")]
    return ((named or lines or ["?"])[-1])[:160].replace("|", "/")


def gib(n) -> str:
    return f"{n / 2**30:.2f}" if n else "n/a"


def write(path: Path, f: dict, tests: dict | None, measured: Path, rows: list[dict], left: list[tuple]) -> None:
    lines = ["# GPU check", "",
             f"Written by `make gpu-check` on {f['date']}: {f['count']} x {f['gpu']} ({f['memory_gib']} GiB), "
             f"driver {f['driver']}, CUDA {f['cuda']}, torch {f['torch']}, NCCL {f['nccl']}, "
             f"DeepSpeed {f['deepspeed']}, Python {f['python']}, {f['cpus']} CPU cores.", ""]
    if tests is not None:
        res = tests["results"]
        counts = {k: sum(r["outcome"] == k for r in res.values()) for k in ("passed", "FAILED", "ERROR", "skipped")}
        lines += ["## The GPU test set (`pytest -m gpu`)", "",
                  f"{counts['passed']} passed, {counts['FAILED']} failed, {counts['ERROR']} errors, "
                  f"{counts['skipped']} skipped, in {tests['wall_s']:.0f} s (the runs start together on the GPUs).", "",
                  "| test | outcome |", "|---|---|"]
        lines += [f"| {name} | {r['outcome']}{': ' + r['why'] if r['why'] else ''} |" for name, r in res.items()]
        for name, r in res.items():  # what a failure printed last (a run's log ends there), to read here
            if r.get("tail"):
                lines += ["", f"<details><summary>{name}</summary>", "", "```", r["tail"], "```", "</details>"]
    plans = sorted(measured.glob("plan-*.json")) if measured.exists() else []
    if plans:
        lines += ["", "## Memory: the plan against the GPU", "",
                  "Per rank, seq 1024, micro-batch 4, bf16, no activation checkpointing: the planner's peak "
                  "(the step's total or start-up, the larger) against `torch.cuda.max_memory_allocated`.", "",
                  "| model | recipe | planned GiB | measured GiB | measured / planned |", "|---|---|---:|---:|---:|"]
        for p in plans:
            d = json.loads(p.read_text())
            lines.append(f"| {d['model']} | {d['recipe']} | {gib(d['planned'])} | {gib(d['measured'])} | {d['ratio']:.3f} |")
    fp16 = sorted(measured.glob("fp16-*.json")) if measured.exists() else []
    if fp16:
        lines += ["", "fp16 (dynamic loss scale): " + "; ".join(
            f"{p.stem.removeprefix('fp16-')} skipped {json.loads(p.read_text())['skipped_steps']} of its steps, scale "
            f"{json.loads(p.read_text())['loss_scale'][0]:g} -> {json.loads(p.read_text())['loss_scale'][-1]:g}"
            for p in fp16) + "."]
    syncs = measured / "host-syncs.json"
    if syncs.exists():
        d = json.loads(syncs.read_text())
        lines += ["", f"Host synchronisations (ddp, profiled steps {d['steps']}, logged {d['logged']}): "
                      f"{d['device_to_host_copies']} device-to-host copies, {d['synchronize_calls']} synchronize calls."]
    for name, title in (("activation-offload", "train.activation_offload (fsdp, gpt_350m, seq 1024, micro-batch 4)"),
                        ("fp8", "precision=fp8 against bf16 (fsdp, gpt_350m, compiled, 200 steps)")):
        if (measured / f"{name}.json").exists():
            d = json.loads((measured / f"{name}.json").read_text())
            lines += ["", f"{title}: " + ", ".join(f"{k} {v:,.4g}" if isinstance(v, float) else f"{k} {v:,}"
                                                   for k, v in d.items()) + "."]
    if rows or left:
        lines += ["", "## Throughput beside the hand-written loops", "",
                  f"bf16, seq {SEQ}, {f['count']} GPU(s); tokens/s over the steps after the first interval (the "
                  "recipe, through `make train`'s launcher) and after 5 warm-up steps (the hand-written loop, "
                  "scripts/bench_*_baseline.py); one round each. MFU from the model's FLOPs per token and the "
                  "GPU's dense bf16 peak.", "",
                  "| model | recipe | compile | micro-batch | tokens/s | hand-written | ratio | MFU | hand-written MFU | "
                  "peak GiB | hand-written peak GiB |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            if "error" in r:
                lines.append(f"| {r['model']} | {r['recipe']} | {'yes' if r['compile'] else 'no'} | {r['micro_batch']} | "
                             f"failed: {error_line(r['error'])} | | | | | | |")
                continue
            lines.append(f"| {r['model']} | {r['recipe']} | {'yes' if r['compile'] else 'no'} | {r['micro_batch']} | "
                         f"{r['tokens_per_s']:,.0f} | {r['baseline_tokens_per_s']:,.0f} | {r['ratio']:.3f} | "
                         f"{100 * r['mfu']:.1f}% | {100 * r['baseline_mfu']:.1f}% | {gib(r['peak_bytes'])} | "
                         f"{gib(r['baseline_peak_bytes'])} |")
        if left:
            lines += ["", "Not run (the time budget was spent): " + ", ".join(
                f"{m} {r}{' compiled' if c else ''}" for m, r, c in left) + "."]
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=float("inf"), help="seconds for the benchmark's cases")
    ap.add_argument("--steps", type=int, default=20, help="steps per benchmark run")
    ap.add_argument("--no-tests", action="store_true", help="the benchmark only")
    ap.add_argument("--cases", default=None, help='bench cases in this order, e.g. "gpt_1b:ddp,gpt_1b:fsdp:compile"')
    ap.add_argument("--no-bench", action="store_true", help="the test set only")
    ap.add_argument("--out", default=str(REPO / "bench" / "gpu.md"))
    ap.add_argument("--keep", default=None, help="folder for the runs and measurements (default: a temporary one)")
    args = ap.parse_args()
    cases = chosen(args.cases)
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA GPU on this machine (torch.cuda.is_available() is False); nothing run")
        return 0
    work = Path(args.keep or tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    f = facts()
    print(f"gpu-check: {f['count']} x {f['gpu']}, driver {f['driver']}, CUDA {f['cuda']}, torch {f['torch']}, "
          f"NCCL {f['nccl']}", flush=True)
    tests = None if args.no_tests else run_tests(work)
    write(Path(args.out), f, tests, work / "measured", [], [])
    rows, left = ([], []) if args.no_bench else run_bench(
        work, args.budget_s, args.steps, cases, lambda rows, left: write(Path(args.out), f, tests, work / "measured", rows, left))
    write(Path(args.out), f, tests, work / "measured", rows, left)
    (work / "gpu.json").write_text(json.dumps({"facts": f, "tests": tests, "bench": rows,
                                               "not_run": left}, indent=1) + "\n")
    failed = tests is not None and tests["returncode"] not in (0, 5)
    return 1 if failed or any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

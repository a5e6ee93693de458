#!/usr/bin/env python
"""`make bench`: each recipe against a hand-written loop on the same model, interleaved.

Steps: each recipe runs through the real launcher (torchrun, the data loader, the loop,
metrics; no checkpoints, no W&B) and its yardstick (scripts/bench_*_baseline.py: the
shortest loop a user would write) through torchrun as well, on the same model, batch,
precision and threads. Round after round every case runs both sides back to back, the
order alternating, so a slow spell of the machine hits both alike; medians, min-max and
the per-round ratios are reported. Start-up: the whole `make train` of a 2-step run
against torchrun of the hand-written 2-step loop, and `--dry-run`. Then the parallel
recipes (tp, pp, tp_fsdp) beside ddp and fsdp on one model and global batch.

Precision: bf16 autocast where the device computes bf16 natively (a CUDA GPU from Ampere
on; a CPU with AVX-512 BF16 or AMX), else fp32: emulated bf16 is about 20x slower, and its
matmuls would hide every overhead the ratios are meant to show. `--dtype` overrides.

Results go to bench/results.md and bench/results.json. A run of some cases (--only, --models,
--no-startup, --no-parallel) replaces those cases' figures and keeps the others, with the
date each was measured, while the machine and the settings stay the same.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench"

# The two model sizes: the 5.3M-parameter Llama-style model (Llama shape at a CPU's
# scale) and gpt_small (12.2M). Both sides compose the model from these overrides.
MODELS = {
    "llama_5m": ["model=gpt_small", "model.dim=256", "model.n_layers=4", "model.n_heads=4", "model.vocab_size=8192"],
    "gpt_small": ["model=gpt_small"],
}
# recipe -> (its hand-written loop, that loop's arguments, target ratio)
CASES = {
    "ddp": ("bench_ddp_baseline.py", [], 0.98),
    "zero1": ("bench_deepspeed_baseline.py", ["--stage", "1"], 0.98),
    "zero2": ("bench_deepspeed_baseline.py", ["--stage", "2"], 0.98),
    "zero3": ("bench_deepspeed_baseline.py", ["--stage", "3"], 0.97),
    "fsdp": ("bench_fsdp_baseline.py", [], 0.97),
}
# The parallel recipes beside ddp and fsdp: (recipe, overrides). Same model, global batch, precision.
PARALLEL_CASES = [
    ("ddp", []),
    ("fsdp", []),
    ("tp", ["parallel.tp=2"]),
    ("pp", ["parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.pp_microbatches=4"]),
    ("tp_fsdp", ["parallel.tp=2"]),
]
STARTUP_TARGET = 1.2


def model_args(name: str) -> list[str]:
    """A bench model's overrides; any other name is a conf/model file."""
    return MODELS.get(name, [f"model={name}"])


def native_bf16() -> tuple[bool, str]:
    """Whether this machine's training device computes bf16 natively, and how that is known."""
    import torch

    if torch.cuda.is_available():
        ok = torch.cuda.is_bf16_supported(including_emulation=False)
        return ok, f"{torch.cuda.get_device_name()} {'supports' if ok else 'does not support'} bf16"
    try:
        flags = set(
            next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
            .split(":", 1)[1]
            .split()
        )
    except (OSError, StopIteration):
        return False, "the CPU's flags could not be read"
    have = sorted(flags & {"avx512_bf16", "amx_bf16"})
    if have:
        return True, f"the CPU has {' and '.join(have)}"
    return False, "the CPU has neither avx512_bf16 nor amx_bf16 (bf16 is emulated, about 20x slower)"


def _run(cmd: list[str], env: dict | None = None) -> float:
    """Run `cmd` in the repository; its wall seconds. Any failure ends the bench with its output."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return time.perf_counter() - t0


class Bench:
    def __init__(self, args):
        self.args = args
        self.threads = max(1, len(os.sched_getaffinity(0)) // args.nproc)
        self.env = {**os.environ, "OMP_NUM_THREADS": str(self.threads)}
        self.runs = OUT / "runs"
        self.runs.mkdir(parents=True, exist_ok=True)

    def train_args(self, recipe: str, model: str, steps: int, extra: list[str], run: Path) -> list[str]:
        a = self.args
        return [
            f"hydra.run.dir={run}",
            f"recipe={recipe}",
            *model_args(model),
            f"precision={a.dtype}",
            f"train.steps={steps}",
            "optim.warmup_steps=5",
            f"train.seq_len={a.seq_len}",
            f"train.micro_batch={a.micro_batch}",
            f"train.global_batch={a.micro_batch * a.nproc}",
            # The loop computes the loss whole: so does the recipe (auto would slice a large
            # vocabulary's logits on a GPU, a memory lever that costs time; docs/memory.md).
            "train.loss_chunks=1",
            "logger=none",
            "logger.log_every=10",
            "checkpoint.every=0",
            "checkpoint.save_final=false",
            f"cluster.nproc_per_node={a.nproc}",
            *extra,
        ]

    def recipe(self, recipe: str, model: str, extra: list[str] = ()) -> dict:
        run = self.runs / f"{recipe}-{model}"
        shutil.rmtree(run, ignore_errors=True)
        _run(
            [
                sys.executable,
                "-m",
                "launcher",
                "train",
                *self.train_args(recipe, model, self.args.steps, list(extra), run),
            ],
            self.env,
        )
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        steady = rows[1:]  # the first interval holds start-up
        tokens_per_step = rows[0]["tokens_per_s"] * rows[0]["step_time_s"]
        return {
            "tokens_per_s": tokens_per_step / statistics.mean(r["step_time_s"] for r in steady),
            "peak_bytes": max(r["mem/peak_bytes"] for r in rows),
            "model_state_bytes": rows[-1]["mem/model_state_bytes"],
        }

    def baseline(
        self, recipe: str, model: str, steps: int | None = None, warmup: int = 10, more: tuple[str, ...] = ()
    ) -> tuple[dict, float]:
        script, extra, _ = CASES[recipe]
        a, out = self.args, self.runs / f"baseline-{recipe}-{model}.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={a.nproc}",
            f"scripts/{script}",
            "--model",
            *model_args(model),
            "--dtype",
            a.dtype,
            "--steps",
            str(steps or a.steps),
            "--warmup",
            str(warmup),
            "--micro-batch",
            str(a.micro_batch),
            "--seq-len",
            str(a.seq_len),
            "--out",
            str(out),
            *extra,
            *more,
        ]
        wall = _run(cmd, self.env)
        return json.loads(out.read_text()), wall

    # ------------------------------------------------------------------ the three parts
    def steps(self, cases: list[tuple[str, str]]) -> list[dict]:
        """Round after round, each case's sides back to back, the order alternating: the recipe
        and its hand-written loop; for the zero recipes also the loop on DeepSpeed's own
        defaults, and the recipe with --variant's overrides when given."""
        seen: dict[tuple[str, str], dict[str, list[dict]]] = {}
        for i in range(self.args.rounds):
            for recipe, model in cases:
                sides = self.sides(recipe, model)
                got = seen.setdefault((recipe, model), {name: [] for name in sides})
                for name in list(sides) if i % 2 == 0 else list(sides)[::-1]:
                    got[name].append(sides[name]())
                print(
                    f"round {i + 1}: {recipe:6} {model:9} "
                    + ", ".join(f"{name} {got[name][-1]['tokens_per_s']:,.0f}" for name in sides)
                    + " tok/s",
                    flush=True,
                )
        return [self.result(recipe, model, got) for (recipe, model), got in seen.items()]

    def sides(self, recipe: str, model: str) -> dict:
        out = {
            "recipe": lambda: self.recipe(recipe, model),
            "loop": lambda: self.baseline(recipe, model)[0],
        }
        if CASES[recipe][0] == "bench_deepspeed_baseline.py":
            out["loop_deepspeed_defaults"] = lambda: self.baseline(recipe, model, more=("--zero", "deepspeed"))[0]
            if self.args.variant:
                out["recipe_variant"] = lambda: self.recipe(recipe, model, self.args.variant.split())
        return out

    def result(self, recipe: str, model: str, got: dict[str, list[dict]]) -> dict:
        ours, theirs = got["recipe"], got["loop"]
        ratios = per_round(ours, theirs)
        out = {
            "recipe": recipe,
            "model": model,
            "target": CASES[recipe][2],
            "recipe_tokens_per_s": [r["tokens_per_s"] for r in ours],
            "baseline_tokens_per_s": [r["tokens_per_s"] for r in theirs],
            "ratios": ratios,
            "ratio": statistics.median(ratios),
            "recipe_peak_bytes": max(r["peak_bytes"] for r in ours),
            "baseline_peak_bytes": max(r.get("peak_bytes", 0) for r in theirs),
            "recipe_model_state_bytes": ours[-1]["model_state_bytes"],
            "baseline_model_state_bytes": theirs[-1].get("model_state_bytes"),
        }
        ds = got.get("loop_deepspeed_defaults")
        if ds:  # the recipe, and its variant, against the same round's loop on DeepSpeed's defaults
            out["loop_deepspeed_defaults"] = {
                "tokens_per_s": [r["tokens_per_s"] for r in ds],
                "peak_bytes": max(r.get("peak_bytes", 0) for r in ds),
            }
            out["recipe_vs_deepspeed_defaults"] = per_round(ours, ds)
            if "recipe_variant" in got:
                v = got["recipe_variant"]
                out["recipe_variant"] = {
                    "overrides": self.args.variant,
                    "tokens_per_s": [r["tokens_per_s"] for r in v],
                    "peak_bytes": max(r["peak_bytes"] for r in v),
                    "vs_deepspeed_defaults": per_round(v, ds),
                }
        return out

    def startup(self) -> dict:
        """Wall seconds of a whole 2-step run of gpt_tiny: `make train` (like for like: no W&B,
        no checkpoint, as the loop has none; then with the defaults) against torchrun of the
        hand-written DDP loop; and `make train ... --dry-run`."""
        run = self.runs / "startup"
        like = self.train_args("ddp", "gpt_tiny", 2, [], run)
        default = [f"hydra.run.dir={run}", "train.steps=2", f"cluster.nproc_per_node={self.args.nproc}"]
        make = ["make", "-s", "train"]
        seen = {
            "make train, 2 steps (no W&B, no checkpoint)": [],
            "torchrun, hand-written 2-step loop": [],
            "make train, 2 steps (defaults: W&B offline, final checkpoint)": [],
            "make train --dry-run": [],
        }
        names = list(seen)
        for i in range(self.args.rounds):
            order = [0, 1, 2, 3] if i % 2 == 0 else [1, 0, 3, 2]
            for k in order:
                shutil.rmtree(run, ignore_errors=True)
                if k == 0:
                    seen[names[k]].append(_run([*make, f"ARGS={' '.join(like)}"], self.env))
                elif k == 1:
                    seen[names[k]].append(self.baseline("ddp", "gpt_tiny", steps=2, warmup=1)[1])
                elif k == 2:
                    seen[names[k]].append(
                        _run([*make, f"ARGS={' '.join(default)}"], {**self.env, "WANDB_MODE": "offline"})
                    )
                else:
                    seen[names[k]].append(_run([*make, f"ARGS={' '.join(like)} --dry-run"], self.env))
            print(f"round {i + 1}: start-up " + ", ".join(f"{v[-1]:.2f}" for v in seen.values()) + " s", flush=True)
        return seen

    def parallel(self) -> list[dict]:
        model = "gpt_small"
        cases = [(name, extra) for name, extra in PARALLEL_CASES if self.args.nproc % degree(extra) == 0]
        if len(cases) < len(PARALLEL_CASES):
            print(
                f"parallel: {self.args.nproc} rank(s) cannot split tp or pp; {', '.join(n for n, _ in cases)} only",
                flush=True,
            )
        seen: dict[str, list[dict]] = {name: [] for name, _ in cases}
        for i in range(self.args.rounds):
            for name, extra in cases if i % 2 == 0 else cases[::-1]:
                seen[name].append(self.recipe(name, model, extra))
        return [
            {
                "recipe": name,
                "overrides": extra,
                "model": model,
                "tokens_per_s": [x["tokens_per_s"] for x in seen[name]],
                "peak_bytes": statistics.median(x["peak_bytes"] for x in seen[name]),
                "model_state_bytes": seen[name][-1]["model_state_bytes"],
            }
            for name, extra in cases
        ]


def per_round(ours: list[dict], theirs: list[dict]) -> list[float]:
    """tokens/s of one side over the other's, round by round."""
    return [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(ours, theirs)]


def degree(overrides: list[str]) -> int:
    """Ranks a parallel case needs at least: its tensor-parallel times pipeline degree."""
    n = 1
    for o in overrides:
        key, _, value = o.partition("=")
        if key in ("parallel.tp", "parallel.pp"):
            n *= int(value)
    return n


def spread(values: list[float], fmt: str = ",.0f") -> str:
    """median (min-max)"""
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def _mib(n) -> str:
    return f"{n / 2**20:,.1f}" if n else "n/a"


def settings(args, threads: int) -> dict:
    """What makes two runs' figures comparable: the machine and the bench's own settings."""
    import torch

    gpu = f"{torch.cuda.get_device_name()}, nccl" if torch.cuda.is_available() else "gloo"
    return {
        "machine": f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores, "
        f"torch {torch.__version__}, {args.nproc} processes x {threads} thread(s), {gpu}",
        "dtype": args.dtype,
        "steps": args.steps,
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
    }


def merge(args, why: str, threads: int, results: list[dict], startup: dict | None, parallel: list[dict]) -> dict:
    """This run's sections over bench/results.json's: a run of some cases (--only, --models,
    --no-startup, --no-parallel) replaces those and keeps the others, each with the date
    it was measured, as long as the machine and settings are the same (else it starts over)."""
    now = {"date": time.strftime("%Y-%m-%d %H:%M"), "rounds": args.rounds}
    data = {"settings": settings(args, threads), "why": why, "steps": [], "startup": None, "parallel": None}
    try:
        old = json.loads((OUT / "results.json").read_text())
    except (OSError, ValueError):
        old = {}
    if old.get("settings") == data["settings"]:
        data.update({k: old.get(k) for k in ("steps", "startup", "parallel")})
    ran = {(r["recipe"], r["model"]) for r in results}
    data["steps"] = [r for r in data["steps"] or [] if (r["recipe"], r["model"]) not in ran] + [
        {**r, **now} for r in results
    ]
    order = {(r, m): i for i, (m, r) in enumerate((m, r) for m in MODELS for r in CASES)}
    data["steps"].sort(key=lambda r: order.get((r["recipe"], r["model"]), len(order)))
    if startup:
        data["startup"] = {**now, "commands": startup}
    if parallel:
        data["parallel"] = {**now, "rows": parallel}
    return data


def write(data: dict) -> None:
    st = data["settings"]
    lines = [
        "# Benchmark results",
        "",
        f"Written by `make bench`; {st['machine']}. Precision **{st['dtype']}**: {data['why']}.",
        "Each case ran its rounds interleaved: each round runs every case's recipe and its "
        "hand-written loop back to back, the order alternating. Tokens/s over the steady steps "
        f"(steps 11-{st['steps']}: the first 10 hold start-up), micro-batch {st['micro_batch']} x {st['seq_len']} "
        "tokens per rank; median (min-max) over the rounds; the ratio is the median of the per-round ratios. "
        "A run of some cases (`--only`, `--models`) keeps the others' rows: each row says when it was measured.",
        "",
        "| recipe | model | recipe tokens/s | hand-written tokens/s | ratio (min-max) | target | "
        "peak MiB recipe / hand-written | model states MiB/rank recipe / hand-written | measured |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in data["steps"]:
        ok = "ok" if r["ratio"] >= r["target"] else "**missed**"
        lines.append(
            f"| {r['recipe']} | {r['model']} | {spread(r['recipe_tokens_per_s'])} | "
            f"{spread(r['baseline_tokens_per_s'])} | {spread(r['ratios'], '.3f')} | >= {r['target']} {ok} | "
            f"{_mib(r['recipe_peak_bytes'])} / {_mib(r['baseline_peak_bytes'])} | "
            f"{_mib(r['recipe_model_state_bytes'])} / {_mib(r['baseline_model_state_bytes'])} | "
            f"{r['date']}, {r['rounds']} rounds |"
        )
    lines += deepspeed_defaults_table(data["steps"])
    run = dict.fromkeys(r["model"] for r in data["steps"])
    lines += [
        "",
        "Models: " + "; ".join(f"`{k}` = `{' '.join(model_args(k))}`" for k in run),
        "Hand-written loops: scripts/bench_ddp_baseline.py (DDP), scripts/bench_deepspeed_baseline.py "
        "(DeepSpeed, the same ZeRO stage and buckets), scripts/bench_fsdp_baseline.py (FSDP2).",
    ]
    if data["startup"]:
        s = data["startup"]
        base = statistics.median(s["commands"]["torchrun, hand-written 2-step loop"])
        lines += [
            "",
            "## Start-up: a whole 2-step run",
            "",
            f"gpt_tiny on the processes above, wall seconds of the whole command, {s['rounds']} rounds interleaved, "
            f"measured {s['date']}; target: `make train` like for like at most {STARTUP_TARGET}x torchrun of "
            "the hand-written loop.",
            "",
            "| command | seconds, median (min-max) | x hand-written |",
            "|---|---:|---:|",
        ]
        for name, values in s["commands"].items():
            lines.append(f"| {name} | {spread(values, '.2f')} | {statistics.median(values) / base:.2f} |")
    if data["parallel"]:
        rows = data["parallel"]["rows"]
        ddp = statistics.median(rows[0]["tokens_per_s"])
        lines += [
            "",
            "## Parallel recipes beside ddp",
            "",
            f"Same bench: {rows[0]['model']}, the same batch and precision, median (min-max) of "
            f"{data['parallel']['rounds']} rounds (interleaved), measured {data['parallel']['date']}. "
            "Model state is what rank 0 holds.",
            "",
            "| recipe | overrides | tokens/s | vs ddp | peak memory/rank | model state/rank |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for r in rows:
            lines.append(
                f"| {r['recipe']} | {' '.join(r['overrides']) or '-'} | {spread(r['tokens_per_s'])} | "
                f"{statistics.median(r['tokens_per_s']) / ddp:.2f} | {_mib(r['peak_bytes'])} MiB | "
                f"{_mib(r['model_state_bytes'])} MiB |"
            )
    (OUT / "results.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT / 'results.md'}")


def deepspeed_defaults_table(rows: list[dict]) -> list[str]:
    """The zero rows against the hand-written loop on DeepSpeed's own defaults (issue 49, 5):
    what a user who writes DeepSpeed's tutorial loop would compare against."""
    rows = [r for r in rows if "loop_deepspeed_defaults" in r]
    if not rows:
        return []
    lines = [
        "",
        "## The zero recipes against a loop on DeepSpeed's own defaults",
        "",
        "The same rounds: the hand-written loop with the stage alone in `zero_optimization` "
        "(buckets of 5e8 elements, overlap_comm at stage 3 only, prefetch 5e7, persistence 1e5), "
        "and the recipe with the overrides named, each ratio against that loop in the same round.",
        "",
        "| recipe | model | loop, DeepSpeed's defaults, tokens/s | recipe / it | recipe with overrides / it | "
        "overrides | peak MiB loop / variant |",
        "|---|---|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        d, v = r["loop_deepspeed_defaults"], r.get("recipe_variant")
        lines.append(
            f"| {r['recipe']} | {r['model']} | {spread(d['tokens_per_s'])} | "
            f"{spread(r['recipe_vs_deepspeed_defaults'], '.3f')} | "
            f"{spread(v['vs_deepspeed_defaults'], '.3f') if v else '-'} | {v['overrides'] if v else '-'} | "
            f"{_mib(d['peak_bytes'])} / {_mib(v['peak_bytes']) if v else '-'} |"
        )
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30, help="steps per run; the first 10 are not timed")
    ap.add_argument("--nproc", type=int, default=None, help="ranks (default: the GPUs there are, else 2 CPU processes)")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto")
    ap.add_argument(
        "--only", nargs="*", default=None, help=f"recipes to run against their loops (default: {' '.join(CASES)})"
    )
    ap.add_argument("--models", nargs="*", default=None, help=f"models (default: {' '.join(MODELS)})")
    ap.add_argument("--no-startup", action="store_true", help="skip the 2-step start-up runs")
    ap.add_argument("--no-parallel", action="store_true", help="skip the parallel recipes beside ddp")
    ap.add_argument(
        "--variant",
        default="",
        help="zero recipes: also run the recipe with these overrides in each round, e.g. "
        '"recipe.zero.reduce_bucket_size=500000000 recipe.zero.allgather_bucket_size=500000000"',
    )
    args = ap.parse_args()
    if args.nproc is None:
        import torch

        args.nproc = torch.cuda.device_count() or 2
    native, why = native_bf16()
    if args.dtype == "auto":
        args.dtype = "bf16" if native else "fp32"
        why = f"{why}, so {args.dtype}"
    else:
        why = f"chosen with --dtype ({why})"
    print(f"precision {args.dtype}: {why}", flush=True)
    bench = Bench(args)
    cases = [(r, m) for m in (args.models or list(MODELS)) for r in (args.only if args.only is not None else CASES)]
    results = bench.steps(cases)
    startup = None if args.no_startup else bench.startup()
    parallel = [] if args.no_parallel else bench.parallel()
    data = merge(args, why, bench.threads, results, startup, parallel)
    (OUT / "results.json").write_text(json.dumps(data, indent=1) + "\n")
    write(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())

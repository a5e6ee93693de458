"""Start-up bench: time to engine ready and the host peak per rank, for chosen recipes
and models on 2 CPU ranks, in this tree and (optionally) in another commit's tree for a
before/after table. Writes bench/startup.md.

    python scripts/bench_startup.py --models gpt_1b --recipes fsdp,zero3 --before <commit>
    python scripts/bench_startup.py --models "" --hf path/to/save_pretrained_folder --recipes fsdp

Each case is one `torchrun --nproc-per-node 2` of this file in --probe mode: a rank
composes the config, joins a gloo process group and builds the engine exactly as a
training rank does (launcher.rank.entry.start; for a tree without it, its build_engine), then
reports its peak RSS and seconds since the process started, and exits before step 1.
`gpt_tiny` under the same recipe is the baseline the issue names: a process that
imported torch (and the recipe's libraries) and built a tiny model.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- probe (one rank)
def probe(tree: str, overrides: list[str]) -> None:
    import contextlib
    import importlib
    import inspect

    import psutil

    started = psutil.Process().create_time()
    sys.path.insert(0, tree)
    os.chdir(tree)
    import torch
    import torch.distributed as dist

    def first(*names):  # this tree's module, or its name before launcher/launch/ and launcher/rank/
        for name in names:
            with contextlib.suppress(ImportError):
                return importlib.import_module(name)
        raise ImportError(names)

    cli = first("launcher.launch.cli", "launcher.cli")
    ds_config = first("launcher.parallel.ds_config", "launcher.ds_config")
    deepspeed_env = first("launcher.host", "launcher.device").deepspeed_env

    cfg, _, _ = cli.compose_config(overrides)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    run_dir = Path(os.environ["PROBE_RUN_DIR"])
    if getattr(cfg.recipe.engine, "value", cfg.recipe.engine) == "zero":
        deepspeed_env()
        if rank == 0:
            (run_dir / ds_config.FILE).write_text(ds_config.text(ds_config.launch_config(cfg, world, False)))
    dist.barrier()
    T = first("launcher.rank.entry", "launcher.train")

    device = torch.device("cpu")
    if hasattr(T, "start"):
        _, startup = T.start(cfg, device, rank, world, rank, run_dir, started)
    else:  # a tree from before start(): every rank built the whole model first
        assert "model" not in inspect.signature(T.build_engine).parameters
        T.build_engine(cfg, device, rank, world, rank, run_dir)
        startup = {
            "host_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "host_built_peak_bytes": None,
            "seconds": round(time.time() - started, 3),
        }
    (run_dir / f"probe_rank{rank}.json").write_text(
        json.dumps({"rank": rank, "code": str(Path(sys.modules["launcher"].__file__).resolve().parents[1]), **startup})
    )
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


# ----------------------------------------------------------------------------- driver
def run_case(tree: Path, overrides: list[str]) -> list[dict]:
    """Each rank's start-up figures (launcher.device.startup_peaks) for one configuration."""
    with tempfile.TemporaryDirectory(prefix="startup-") as run_dir:
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(REPO / "scripts" / "bench_startup.py"),
            "--probe",
            str(tree),
            *overrides,
        ]
        env = {**os.environ, "PROBE_RUN_DIR": run_dir, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree)}
        proc = subprocess.run(argv, cwd=tree, capture_output=True, text=True, env=env, timeout=1800)
        rows = [json.loads(p.read_text()) for p in sorted(Path(run_dir).glob("probe_rank*.json"))]
    if proc.returncode != 0 or len(rows) != 2:
        raise SystemExit(
            f"{' '.join(overrides)} in {tree}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    assert all(Path(r["code"]) == tree.resolve() for r in rows), (rows, tree)  # the tree measured is the tree named
    return rows


def worktree(rev: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix="startup-before-")) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], cwd=REPO, check=True, capture_output=True)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--probe", metavar="TREE", help=argparse.SUPPRESS)
    ap.add_argument("--models", default="gpt_1b")
    ap.add_argument("--recipes", default="fsdp,zero3")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument(
        "--hf",
        metavar="FOLDER",
        action="append",
        default=[],
        help="also a save_pretrained folder: model=hf model.pretrained=FOLDER (read shard-wise)",
    )
    ap.add_argument("--before", metavar="REV", help="also measure this commit's tree (the code before a change)")
    ap.add_argument("--out", default=str(REPO / "bench" / "startup.md"))
    args, rest = ap.parse_known_args()
    if args.probe:
        probe(args.probe, rest)
        return 0
    from launcher import models
    from launcher.launch import cli

    trees = {"after": REPO}
    if args.before:
        trees = {"before": worktree(args.before), **trees}
    lines = [
        f"# Start-up: engine ready, 2 CPU ranks, {args.precision}",
        "",
        f"{time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores; `python scripts/bench_startup.py --models {args.models} --recipes {args.recipes}"
        f" --precision {args.precision}{' --before ' + args.before if args.before else ''}`.",
        "",
        "Per rank, the worst of the two: peak RSS when the engine is ready (before step 1), the peak when "
        "this rank's part of the model was built (before the recipe's optimizer set-up; n/a before the change), "
        "seconds from process start. Ψ = parameters; the issue's target is 0.5 x 4Ψ + the gpt_tiny baseline "
        "(the same recipe's process with a tiny model).",
        "",
        "| tree | recipe | model | Ψ | host peak (GiB) | model built (GiB) | baseline (GiB) | (peak - baseline) / 4Ψ "
        "| (built - baseline) / 4Ψ | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, tree in trees.items():
        for recipe in args.recipes.split(","):
            base = run_case(tree, [f"recipe={recipe}", "model=gpt_tiny", f"precision={args.precision}"])
            base_peak = max(r["host_peak_bytes"] for r in base)
            cases = [(m, [f"model={m}"]) for m in args.models.split(",") if m]
            cases += [(f"hf:{Path(f).name}", ["model=hf", f"model.pretrained={Path(f).resolve()}"]) for f in args.hf]
            for model, overrides in cases:
                cfg, _, _ = cli.compose_config(overrides)
                psi = sum(p.numel() for p in models.on_meta(cfg).parameters())
                rows = run_case(tree, [f"recipe={recipe}", *overrides, f"precision={args.precision}"])
                peak = max(r["host_peak_bytes"] for r in rows)
                built = max((r["host_built_peak_bytes"] or 0) for r in rows) or None
                secs = max(r["seconds"] for r in rows)
                gib = lambda v: f"{v / 2**30:.2f}" if v else "n/a"  # noqa: E731
                line = (
                    f"| {label} | {recipe} | {model} | {psi / 1e9:.2f}B | {gib(peak)} | {gib(built)} | {gib(base_peak)} "
                    f"| {(peak - base_peak) / (4 * psi):.3f} | "
                    f"{f'{(built - base_peak) / (4 * psi):.3f}' if built else 'n/a'} | {secs:.1f} |"
                )
                print(line, flush=True)
                lines.append(line)
    if args.before:
        subprocess.run(["git", "worktree", "remove", "--force", str(trees["before"])], cwd=REPO, capture_output=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Save-stall bench: how long training stops for a checkpoint, saved synchronously and
with checkpoint.async_save, for chosen recipes and models on 2 CPU ranks. Writes
bench/save.md.

    python scripts/bench_save.py --cases fsdp:gpt_350m,zero2:gpt_350m [--before <commit>]

Each case is one real `launcher train` (fp32, micro-batch 1, sequence 64: short steps, a
checkpoint of the model's full size) of STEPS steps with two checkpoints, after steps
EVERY and 2 x EVERY (the first allocates the async save's host buffers, the second reuses
them, as every later save of a run does). Rank 0 prints a line per step and one when a
save lets training go on; from the times those lines arrive here:
  stall: from the step line before a save to its checkpoint line (sync: the whole save,
         the recipe's write, the digests, the manifest, the renames; async: the copy into
         host memory), first and second save;
  lost:  what the two saves added to the run, the steps after the first save against the
         median step before it (async: the stalls plus what the background writes take
         from the steps they overlap: on this 2-core machine they compete with the ranks
         for the cores and the memory bandwidth).
A --before commit runs the sync cases only (its tree may not know async_save).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EVERY, STEPS = 4, 11


def run_case(tree: Path, model: str, recipe: str, mode: str, scratch: Path) -> dict:
    """The stalls of the two saves and the time they lost, in seconds; the checkpoint's bytes."""
    run_dir = scratch / f"{recipe}-{model}-{tree.name}-{mode}"
    argv = [
        sys.executable,
        "-m",
        "launcher",
        "train",
        f"model={model}",
        f"recipe={recipe}",
        f"train.steps={STEPS}",
        f"checkpoint.every={EVERY}",
        "checkpoint.save_final=false",
        "checkpoint.keep=1",
        "train.micro_batch=1",
        "train.seq_len=64",
        "optim.warmup_steps=0",
        "logger=none",
        "logger.log_every=1",
        f"hydra.run.dir={run_dir}",
        "cluster.nproc_per_node=2",
    ]
    if mode == "async":
        argv.append("checkpoint.async_save=true")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(tree)}
    proc = subprocess.Popen(argv, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    steps: dict[int, float] = {}
    resumed: dict[int, float] = {}  # save step -> when training went on
    tail: list[str] = []
    for line in proc.stdout:
        now = time.monotonic()
        tail = (tail + [line])[-40:]
        if line.startswith("step "):
            steps[int(line.split()[1])] = now
        elif line.startswith("checkpoint ") and "written in the background" not in line:
            resumed.setdefault(int(line.split()[1].rstrip(":").rsplit("_", 1)[1]), now)
    if proc.wait() != 0 or sorted(resumed) != [EVERY, 2 * EVERY] or len(steps) != STEPS:
        raise SystemExit(f"{recipe} {mode} in {tree}: exit {proc.returncode}\n{''.join(tail)}")
    gaps = {s: steps[s] - steps[s - 1] for s in range(2, STEPS + 1)}
    steady = statistics.median(gaps[s] for s in range(2, EVERY + 1))
    lost = sum(gaps[s] - steady for s in range(EVERY + 1, STEPS + 1))
    size = sum(p.stat().st_size for p in (run_dir / "checkpoints").rglob("*") if p.is_file())
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    return {
        "stall_s": [resumed[s] - steps[s] for s in (EVERY, 2 * EVERY)],
        "lost_s": lost,
        "step_s": steady,
        "bytes": size,
    }


def tree_of(commit: str, scratch: Path) -> Path:
    path = scratch / f"tree-{commit[:10]}"
    subprocess.run(["git", "worktree", "add", "--detach", str(path), commit], cwd=REPO, check=True, capture_output=True)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--cases",
        default="fsdp:gpt_125m,fsdp:gpt_350m,zero2:gpt_125m,zero2:gpt_350m",
        help="recipe:model pairs (an async save holds a second copy of the state in host memory: "
        "on a 24 GiB machine without a GPU gpt_1b does not fit twice)",
    )
    ap.add_argument("--before", help="a commit to compare with, sync only (checked out into a worktree)")
    ap.add_argument("--out", default=str(REPO / "bench" / "save.md"))
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench-save-", dir=os.environ.get("BENCH_DIR", "/tmp")))
    runs = [("after", REPO, "sync"), ("after", REPO, "async")]
    if args.before:
        runs = [("before", tree_of(args.before, scratch), "sync")] + runs
    rows = []
    try:
        for case in args.cases.split(","):
            recipe, model = case.split(":")
            for name, tree, mode in runs:
                rows.append(
                    {
                        "recipe": recipe,
                        "model": model,
                        "tree": name,
                        "mode": mode,
                        **run_case(tree, model, recipe, mode, scratch),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    finally:
        for name, tree, _ in runs:
            if tree != REPO:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, capture_output=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    lines = [
        "# Save stall per checkpoint, 2 CPU ranks (fp32)",
        "",
        f"`python scripts/bench_save.py --cases {args.cases}" + (f" --before {args.before}`" if args.before else "`"),
        f"on {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{time.strftime('%Y-%m-%d')}, after = {head.strip()} (with uncommitted changes, if any).",
        "",
        "| recipe | model | tree | save | checkpoint size | step | stall, 1st save | stall, 2nd save | lost (both) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['recipe']} | {r['model']} | {r['tree']} | {r['mode']} | {r['bytes'] / 2**30:.2f} GiB | "
        f"{r['step_s']:.2f} s | {r['stall_s'][0]:.2f} s | {r['stall_s'][1]:.2f} s | {r['lost_s']:.1f} s |"
        for r in rows
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(Path(args.out).read_text())


if __name__ == "__main__":
    main()

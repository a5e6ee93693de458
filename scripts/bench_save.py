"""Save-stall bench: how long training stops for each checkpoint, for chosen recipes and a
model on 2 CPU ranks, in this tree and (optionally) another commit's tree for a
before/after table. Writes bench/save.md.

    python scripts/bench_save.py --cases fsdp:gpt_1b,zero2:gpt_350m --before <commit>

Each case is one real `launcher train` of one step and its checkpoint (fp32, micro-batch
1, sequence 64: the step is short, the checkpoint the model's full size). Rank 0 prints the
step line, saves, then prints the checkpoint line; the stall is the time between the two
lines as they arrive here (the whole save: the recipe's write, the digests, the manifest,
the renames). One step, because the rank's memory after a save of gpt_1b in fp32 leaves no
room for a second step on a 24 GiB machine with 2 ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_case(tree: Path, model: str, recipe: str, scratch: Path) -> tuple[float, int]:
    """The stall of the save in seconds, and the checkpoint's bytes."""
    run_dir = scratch / f"{recipe}-{tree.name}"
    argv = [sys.executable, "-m", "launcher", "train", f"model={model}", f"recipe={recipe}", "train.steps=1",
            "checkpoint.every=1", "train.micro_batch=1", "train.seq_len=64",
            "optim.warmup_steps=0", "logger=none", "logger.log_every=1", f"hydra.run.dir={run_dir}",
            "cluster.nproc_per_node=2"]
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(argv, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stalls, stepped, tail = [], None, []
    for line in proc.stdout:
        now = time.monotonic()
        tail = (tail + [line])[-40:]
        if line.startswith("step "):
            stepped = now
        elif line.startswith("checkpoint ") and stepped is not None:
            stalls.append(now - stepped)
            stepped = None
    if proc.wait() != 0 or len(stalls) != 1:
        raise SystemExit(f"{recipe} in {tree}: exit {proc.returncode}, stalls {stalls}\n{''.join(tail)}")
    size = sum(p.stat().st_size for p in (run_dir / "checkpoints").rglob("*") if p.is_file())
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    return stalls[0], size


def tree_of(commit: str, scratch: Path) -> Path:
    path = scratch / f"tree-{commit[:10]}"
    subprocess.run(["git", "worktree", "add", "--detach", str(path), commit], cwd=REPO, check=True,
                   capture_output=True)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="fsdp:gpt_1b,zero2:gpt_350m",
                    help="recipe:model pairs (zero2 holds 14 bytes per parameter in fp32: gpt_1b does not fit in 24 GiB)")
    ap.add_argument("--before", help="a commit to compare with (checked out into a worktree)")
    ap.add_argument("--out", default=str(REPO / "bench" / "save.md"))
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench-save-", dir=os.environ.get("BENCH_DIR", "/tmp")))
    trees = {"after": REPO}
    if args.before:
        trees = {"before": tree_of(args.before, scratch), **trees}
    rows = []
    try:
        for case in args.cases.split(","):
            recipe, model = case.split(":")
            for name, tree in trees.items():
                stall, size = run_case(tree, model, recipe, scratch)
                rows.append({"recipe": recipe, "model": model, "tree": name, "stall_s": stall, "bytes": size})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        for name, tree in trees.items():
            if tree != REPO:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, capture_output=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    lines = ["# Save stall per checkpoint, 2 CPU ranks (fp32)", "",
             f"`python scripts/bench_save.py --cases {args.cases}"
             + (f" --before {args.before}`" if args.before else "`"),
             f"on {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
             f"{time.strftime('%Y-%m-%d')}, after = {head.strip()} (with uncommitted changes, if any).", "",
             "| recipe | model | tree | checkpoint size | save stall |", "|---|---|---|---|---|"]
    lines += [f"| {r['recipe']} | {r['model']} | {r['tree']} | {r['bytes'] / 2**30:.1f} GiB | {r['stall_s']:.1f} s |"
              for r in rows]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(Path(args.out).read_text())


if __name__ == "__main__":
    main()

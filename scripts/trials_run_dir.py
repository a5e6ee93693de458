"""Trials of issue 14's promise that no launch loses a checkpoint: relaunches into a used
run directory and launches that collide, each repeated with random timings, every
checkpoint on disk checked after every launch. Writes bench/trust.md.

    python scripts/trials_run_dir.py [--rounds 3] [--seed 0]

Each trial starts from run A: the default model on 2 CPU ranks, 6 steps, a checkpoint
every 2 (keep 2). Then one of:
  auto         the same run directory launched again to 10 steps: resumes A, finishes
  never        a fresh start (checkpoint.resume=never): refused, exit 2, no file changed
  archive      a fresh start with checkpoint.on_existing=archive: A moved aside whole
  concurrent   two launches to 40 steps started 0-3 s apart: one trains, one is refused
  shared_ckpt  a second run whose checkpoint.dir is A's, while A trains on: refused
  kill9        the launcher SIGKILLed 2-8 s into a relaunch to 40 steps; launched again:
               resumes and finishes
Each trial's launches save synchronously or with checkpoint.async_save, at random.
After every launch each checkpoint folder (RUN_DIR/checkpoints and RUN_DIR/archive/*)
is read: a `step_*` folder whose manifest does not verify counts as corrupt; a checkpoint
once seen whole that is gone (not deleted by its own run's keep-K, which keeps the
newest 2) counts as lost; `latest` must name a whole checkpoint of its run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from launcher.manifest import read_latest, verify  # noqa: E402

BASE = ["logger=none", "optim.warmup_steps=1", "checkpoint.every=2", "checkpoint.keep=2", "cluster.nproc_per_node=2"]
KINDS = ("auto", "never", "archive", "concurrent", "shared_ckpt", "kill9")


def launch(run_dir: Path, *overrides: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "launcher", "train", f"hydra.run.dir={run_dir}", *BASE, *overrides]
    return subprocess.Popen(
        argv,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    out = proc.communicate(timeout=timeout)[0]
    return proc.returncode, out


def folders(run_dir: Path) -> list[Path]:
    roots = [run_dir / "checkpoints", *sorted((run_dir / "archive").glob("*/checkpoints"))]
    return [root for root in roots if root.is_dir()]


def snapshot(run_dir: Path) -> tuple[dict, list[str]]:
    """{(run id, step): digest of its manifest} of every whole checkpoint, and the problems."""
    whole, problems = {}, []
    for root in folders(run_dir):
        for folder in sorted(root.glob("step_*")):
            if folder.name.endswith(".tmp") or ".aside." in folder.name:
                continue
            why = verify(folder)
            if why is not None:
                problems.append(f"corrupt {folder}: {why}")
                continue
            manifest = json.loads((folder / "manifest.json").read_text())
            whole[(manifest["run_id"], manifest["step"])] = hashlib.sha256(
                json.dumps(manifest["files"], sort_keys=True).encode()
            ).hexdigest()
        latest = read_latest(root)
        if latest is not None and not (root / latest[0] / "manifest.json").is_file():
            problems.append(f"{root}/latest names {latest[0]}, which is not a whole checkpoint")
    return whole, problems


class Ledger:
    """Every whole checkpoint seen so far; what went missing since, beyond keep-K."""

    def __init__(self, keep: int = 2):
        self.keep, self.seen, self.lost, self.corrupt = keep, {}, [], []
        self.ever: set = set()  # every whole checkpoint seen, for the count

    def check(self, run_dir: Path) -> None:
        now, problems = snapshot(run_dir)
        self.corrupt += problems
        for key, digest in now.items():
            if key in self.seen and self.seen[key] != digest:
                self.corrupt.append(f"checkpoint {key} changed on disk")
        self.seen.update(now)
        self.ever |= set(now)
        for run_id in {r for r, _ in self.seen}:
            steps = sorted(s for r, s in self.seen if r == run_id)
            kept = steps[-self.keep :]  # keep-K of its own run may delete the older ones
            for step in kept:
                if (run_id, step) not in now:
                    self.lost.append(f"run {run_id} step {step}")
                    self.seen.pop((run_id, step))


def trial(kind: str, scratch: Path, rng: random.Random) -> dict:
    run = scratch / f"{kind}-{rng.randrange(10**6)}"
    ledger = Ledger()
    saving = rng.choice(["sync", "async"])  # the trial's launches save this way

    def start(run_dir: Path, *overrides: str) -> subprocess.Popen:
        return launch(run_dir, *overrides, f"checkpoint.async_save={saving == 'async'}")

    rc, out = finish(start(run, "train.steps=6"))
    assert rc == 0, out[-2000:]
    ledger.check(run)
    codes = []
    if kind == "auto":
        rc, out = finish(start(run, "train.steps=10"))
        codes.append(rc)
        ok = rc == 0 and "at step 6 " in out
    elif kind == "never":
        before = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
        rc, out = finish(start(run, "train.steps=10", "checkpoint.resume=never"))
        codes.append(rc)
        after = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
        ok = rc == 2 and before == after
    elif kind == "archive":
        rc, out = finish(start(run, "train.steps=4", "checkpoint.resume=never", "checkpoint.on_existing=archive"))
        codes.append(rc)
        ok = rc == 0 and len(list((run / "archive").glob("*/checkpoints/step_*"))) == 2
    elif kind == "concurrent":
        first = start(run, "train.steps=40")
        time.sleep(rng.uniform(0, 3))
        second = start(run, "train.steps=40")
        (rc2, out2), (rc1, out1) = finish(second), finish(first)
        codes += [rc1, rc2]
        ok = sorted(codes) == [0, 2]
    elif kind == "shared_ckpt":
        first = start(run, "train.steps=40")
        time.sleep(rng.uniform(2, 5))
        other = scratch / f"other-{rng.randrange(10**6)}"
        rc2, out2 = finish(start(other, "train.steps=40", f"checkpoint.dir={run / 'checkpoints'}"))
        rc1, out1 = finish(first)
        codes += [rc1, rc2]
        ok = rc1 == 0 and rc2 == 2 and not other.exists()
    else:  # kill9
        proc = start(run, "train.steps=40")
        time.sleep(rng.uniform(2, 8))
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
        deadline = time.monotonic() + 90  # the orphaned ranks save and stop (PR_SET_PDEATHSIG)
        while (
            time.monotonic() < deadline
            and subprocess.run(["pgrep", "-f", str(run)], capture_output=True).returncode == 0
        ):
            time.sleep(0.5)
        ledger.check(run)
        rc, out = finish(start(run, "train.steps=40"))
        codes += [-9, rc]
        ok = rc == 0
    ledger.check(run)
    return {
        "kind": kind,
        "saving": saving,
        "ok": ok,
        "codes": codes,
        "lost": ledger.lost,
        "corrupt": ledger.corrupt,
        "checkpoints_seen": len(ledger.ever),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "trust.md")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    results = []
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="trials-") as tmp:
        for n in range(args.rounds):
            for kind in args.kinds.split(","):
                r = trial(kind, Path(tmp), rng)
                results.append(r)
                print(json.dumps(r), flush=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    lines = [
        "# Trials: no launch loses a checkpoint",
        "",
        f"`python scripts/trials_run_dir.py --rounds {args.rounds} --seed {args.seed}` on {platform.machine()}, "
        f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}, at {commit} (with uncommitted changes, if any); "
        f"{(time.time() - t0) / 60:.0f} min.",
        "",
        "| trial | runs (async) | as promised | exit codes | checkpoints seen whole | lost | corrupt |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind in args.kinds.split(","):
        rows = [r for r in results if r["kind"] == kind]
        codes = sorted({tuple(r["codes"]) for r in rows})
        asynchronous = sum(r["saving"] == "async" for r in rows)
        lines.append(
            f"| {kind} | {len(rows)} ({asynchronous}) | {sum(r['ok'] for r in rows)} | "
            f"{', '.join('/'.join(map(str, c)) for c in codes)} | {sum(r['checkpoints_seen'] for r in rows)} | "
            f"{sum(len(r['lost']) for r in rows)} | {sum(len(r['corrupt']) for r in rows)} |"
        )
    lines += ["", "```", __doc__.split("\n\n", 2)[2].strip(), "```", ""]
    problems = [p for r in results for p in r["lost"] + r["corrupt"]]
    if problems:
        lines += ["Problems:", "", *[f"- {p}" for p in problems], ""]
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")
    return 0 if not problems and all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

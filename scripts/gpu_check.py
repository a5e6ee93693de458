#!/usr/bin/env python
"""`make gpu-check`: the GPU cases (scripts/gpu_cases.py) in priority order, within a budget
of device time, each appended to bench/gpu.md as it ends (scripts/gpu_report.py).

    make gpu-check ARGS=--dry-run                  # here, on CPU: the cases, their planned memory, the time each
                                                   # took last time (bench/gpu_times.json), what the budget drops
    make gpu-check                                 # on a GPU: --budget-s 720, the install's time included
    make gpu-check ARGS="--call-s 540 --mirror $OUT"        # one call of at most 9 minutes (the device tool
    make gpu-check ARGS="--resume --mirror $OUT"            # allows 10 a command); then the rest, in a second

The budget: --budget-s less the install (bench/gpu_times.json's figure, or --install-s) is
what the cases may take. Before starting, the cases whose last times do not fit are dropped,
lowest priority first. While running, a case is started only when its last time fits in what
is left, and is stopped (its process group killed) when the budget runs out; either way it is
named in bench/gpu.md with the reason. Each case's time goes to bench/gpu_times.json as it
ends. Without a CUDA GPU (and without --dry-run) it says so in one line and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from gpu_cases import HF_MODELS, Case, standin  # noqa: E402
from gpu_cases import cases as all_cases  # noqa: E402
from gpu_report import Report  # noqa: E402

TIMES = REPO / "bench" / "gpu_times.json"
WORK = REPO / ".gpu-check"


# ----------------------------------------------------------------------------- times and budget
def load_times(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {"install": {"seconds": 60, "source": "estimate"}, "cases": {}}


def estimate(times: dict, name: str) -> tuple[float, str]:
    """(seconds, where the figure comes from): the last measured time, else the estimate."""
    t = times["cases"].get(name)
    return (float(t["seconds"]), t["source"]) if t else (300.0, "estimate: no figure in bench/gpu_times.json")


def fit(cases: list[Case], times: dict, seconds: float) -> tuple[list[Case], list[Case]]:
    """(kept, dropped): the lowest-priority cases dropped, one by one from the end, until the
    last times of those kept add up to at most `seconds`."""
    kept = list(cases)
    dropped: list[Case] = []
    while kept and sum(estimate(times, c.name)[0] for c in kept) > seconds:
        dropped.insert(0, kept.pop())
    return kept, dropped


def record_time(path: Path, name: str, seconds: float, status: str, where: str) -> None:
    """A case's time into bench/gpu_times.json: what it took when it ended by itself; when the
    budget stopped it or it failed, the larger of that and the figure before (a lower bound)."""
    times = load_times(path)
    before = times["cases"].get(name, {}).get("seconds", 0)
    if status == "passed":
        entry = {"seconds": round(seconds), "source": f"measured {time.strftime('%Y-%m-%d')} on {where}"}
    else:
        entry = {
            "seconds": round(max(seconds, before)),
            "source": f"{status} after {seconds:.0f} s on {time.strftime('%Y-%m-%d')}, {where}: at least that",
        }
    times["cases"][name] = entry
    Path(path).write_text(json.dumps(times, indent=1) + "\n")


# ----------------------------------------------------------------------------- planned memory
def planned(case: Case, hf_folders: dict[str, Path]) -> dict[str, dict]:
    """Each run's planned peak and start-up per GPU (the planner's memory_row at the run's
    world size), or why the launcher refuses it. model=hf runs are planned from the Llama's
    config.json (`hf_folders`, by model): the planner needs the shape, not the weights."""
    from launcher.config import ConfigError
    from launcher.launch import cli
    from launcher.planner import plan as planner

    out = {}
    for name, overrides in case.runs.items():
        over = list(overrides)
        for model, folder in hf_folders.items():
            over = [o.replace(f"model.pretrained={standin(model)}", f"model.config={folder}") for o in over]
        try:
            cfg, _, _ = cli.compose_config(over)
            cfg = planner.planned_model(cfg)
            world = cfg.cluster.nproc_per_node or 1
            row = planner.memory_row(
                cfg, planner.layout_for(cfg, world), cfg.train.activation_checkpointing, cfg.train.micro_batch
            )
            out[name] = {"peak": row.peak, "startup": row.startup}
        except (ConfigError, SystemExit) as err:
            out[name] = {"error": str(err).splitlines()[0][:160]}
    return out


def llama_configs(root: Path) -> dict[str, Path]:
    """A folder with config.json alone for each Hugging Face model of the cases."""
    out = {}
    for model, shape in HF_MODELS.items():
        (root / model).mkdir(parents=True, exist_ok=True)
        (root / model / "config.json").write_text(
            json.dumps(
                {**shape, "model_type": "llama", "torch_dtype": "bfloat16", "architectures": ["LlamaForCausalLM"]}
            )
        )
        out[model] = root / model
    return out


def dry_run(
    cases: list[Case], times: dict, budget_s: float, install_s: float, as_json: bool, memory: bool = True
) -> int:
    kept, dropped = fit(cases, times, budget_s - install_s)
    with tempfile.TemporaryDirectory(prefix="gpu-check-plan-") as tmp:
        folders = llama_configs(Path(tmp))
        rows = []
        for i, c in enumerate(cases, 1):
            seconds, source = estimate(times, c.name)
            plans = planned(c, folders) if memory else {name: {} for name in c.runs}
            peaks = [p["peak"] for p in plans.values() if "peak" in p]
            rows.append(
                {
                    "priority": i,
                    "name": c.name,
                    "part": c.part,
                    "what": c.what,
                    "seconds": seconds,
                    "source": source,
                    "kept": c in kept,
                    "runs": plans,
                    "max_peak": max(peaks, default=0),
                    "sum_peak": sum(peaks),
                }
            )
    if as_json:
        print(json.dumps({"budget_s": budget_s, "install_s": install_s, "cases": rows}, indent=1))
        return 0
    print(
        f"gpu-check --dry-run: budget {budget_s:.0f} s, install {install_s:.0f} s "
        f"({times['install']['source']}); the cases in priority order:"
    )
    for r in rows:
        mark = "run " if r["kept"] else "DROP"
        peak = f", planned peak per GPU up to {r['max_peak'] / 2**30:.2f} GiB" if memory and r["runs"] else ""
        print(
            f"{mark} {r['priority']:2}. {r['name']:22} about {r['seconds']:4.0f} s ({r['source']}); "
            f"{len(r['runs'])} launcher run(s){peak}"
        )
        for name, p in r["runs"].items():
            figure = (
                f"peak {p['peak'] / 2**30:6.2f} GiB, start-up {p['startup'] / 2**30:6.2f} GiB"
                if "peak" in p
                else f"refused: {p['error']}"
                if "error" in p
                else ""
            )
            print(f"         {name:32} {figure}")
    total = sum(r["seconds"] for r in rows if r["kept"])
    print(
        f"kept: {total:.0f} s of cases + {install_s:.0f} s install = {total + install_s:.0f} s of {budget_s:.0f} s; "
        f"dropped (lowest priority first): {', '.join(c.name for c in dropped) or 'none'}"
    )
    return 0


# ----------------------------------------------------------------------------- running
def run_case(case: Case, left: float, folder: Path) -> tuple[str, str]:
    """The case's process, in its own process group, stopped with the group when `left`
    seconds are up. (status, the end of its output)."""
    if callable(case.argv):  # a case given as a function (the unit test's stand-ins)
        return case.argv(left, folder)
    argv = [a.replace("{out}", str(folder)) for a in case.argv]
    env = {**os.environ, **case.env, "GPU_CHECK_OUT": str(folder / "measured"), "PYTHONUNBUFFERED": "1"}
    with open(folder / "output.log", "w") as log:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=max(left, 0))
            status = "passed" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            proc.wait()
            status = "stopped at the budget"
    return status, (folder / "output.log").read_text()[-3000:]


def kill_tree(pid: int) -> None:
    """SIGKILL to the case's process group and to every process under it: the launcher starts
    torchrun in a session of its own, and its ranks would otherwise finish their step and save
    (a preemption) on the GPU the next case needs."""
    import psutil

    try:
        below = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        below = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    for p in below:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(below, timeout=30)


def check(
    cases: list[Case],
    times_path: Path,
    budget_s: float,
    install_s: float,
    report: Report,
    work: Path,
    where: str,
    spent_before: float = 0.0,
    call_s: float | None = None,
    clock=time.monotonic,
    done: dict | None = None,
) -> dict:
    """Run the cases in order within the budget, each appended to the report as it ends, and
    the state for --resume saved after each (work/state.json: a call stopped from outside
    loses at most the case it was in). {case name: status}, the skipped ones included."""
    t0 = clock()
    deadline = t0 + budget_s - install_s - spent_before
    if call_s is not None:
        deadline = min(deadline, t0 + call_s)
    done = done if done is not None else {}
    skipped = []
    for case in cases:
        left = deadline - clock()
        need = estimate(load_times(times_path), case.name)[0]
        if need > left:
            why = f"needs about {need:.0f} s, {max(left, 0):.0f} s left"
            skipped.append((case.name, why))
            done.setdefault(case.name, "skipped")
            continue
        folder = work / case.name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        started = clock()
        try:
            status, tail = run_case(case, left, folder)
        except Exception as err:  # the check goes on to the next case
            status, tail = f"error ({type(err).__name__})", repr(err)
        seconds = clock() - started
        record_time(times_path, case.name, seconds, "passed" if status == "passed" else status, where)
        report.case(case.name, case.what, status, seconds, folder, tail)
        done[case.name] = status
        save_state(work, spent_before + clock() - t0, done, report, times_path)
    report.end(skipped, spent_before + install_s + clock() - t0, budget_s)
    save_state(work, spent_before + clock() - t0, done, report, times_path)
    return done


def save_state(work: Path, spent: float, done: dict, report: Report, times_path: Path) -> None:
    """What --resume needs: the seconds spent, each case's status, the section appended so far
    and the times measured (the next call's working tree has neither file as this one left it)."""
    (work / "state.json").write_text(
        json.dumps(
            {"spent_s": spent, "done": done, "section": report.written, "times": load_times(times_path)["cases"]},
            indent=1,
        )
    )


def facts() -> dict:
    import torch

    driver = "unknown"
    if shutil.which("nvidia-smi"):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        )
        driver = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else driver
    try:
        from importlib.metadata import version

        deepspeed = version("deepspeed")
    except Exception:
        deepspeed = "not installed"
    nccl = torch.cuda.nccl.version()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "gpu": torch.cuda.get_device_name(0),
        "count": torch.cuda.device_count(),
        "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
        "driver": driver,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
        "deepspeed": deepspeed,
        "python": platform.python_version(),
        "cpus": len(os.sched_getaffinity(0)),
    }


def chosen(spec: str | None) -> list[Case]:
    """--cases "a-bf16-none,b-fsdp-gpt_350m": those cases, in that order; default all."""
    every = all_cases()
    if not spec:
        return every
    names = {c.name: c for c in every}
    wrong = [n for n in spec.split(",") if n.strip() not in names]
    if wrong:
        print(f"gpu-check: --cases {','.join(wrong)}: not a case; the cases are {', '.join(names)}", file=sys.stderr)
        raise SystemExit(2)
    return [names[n.strip()] for n in spec.split(",")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--dry-run", action="store_true", help="list the cases, planned memory, last times, what is dropped"
    )
    ap.add_argument("--json", action="store_true", help="with --dry-run: as JSON")
    ap.add_argument("--no-memory", action="store_true", help="with --dry-run: without the planned memory (quicker)")
    ap.add_argument("--budget-s", type=float, default=720.0, help="device seconds in all, the install included")
    ap.add_argument(
        "--install-s", type=float, default=None, help="the install's seconds (default: bench/gpu_times.json's)"
    )
    ap.add_argument(
        "--call-s", type=float, default=None, help="the most this call may take (the device tool: 600 a command)"
    )
    ap.add_argument(
        "--resume", action="store_true", help="go on from the previous call: skip its cases, count its time"
    )
    ap.add_argument("--cases", default=None, help="these cases, in this order (names as --dry-run lists them)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "gpu.md")
    ap.add_argument("--times", type=Path, default=TIMES)
    ap.add_argument("--mirror", type=Path, default=None, help="copy bench/gpu.md and the times here after each case")
    ap.add_argument("--work", type=Path, default=WORK, help="the cases' folders and the state for --resume")
    args = ap.parse_args(argv)
    cases = chosen(args.cases)
    times = load_times(args.times)
    install_s = args.install_s if args.install_s is not None else float(times["install"]["seconds"])
    if args.dry_run:
        return dry_run(cases, times, args.budget_s, install_s, args.json, memory=not args.no_memory)
    import torch

    if not torch.cuda.is_available():
        print(
            "gpu-check: no CUDA GPU on this machine (torch.cuda.is_available() is False); nothing run "
            "(--dry-run lists the cases)"
        )
        return 0
    state_path = args.work / "state.json"
    state = json.loads(state_path.read_text()) if args.resume and state_path.exists() else {}
    spent_before, done = state.get("spent_s", 0.0), state.get("done", {})
    todo = [c for c in cases if done.get(c.name, "skipped") == "skipped"]
    args.work.mkdir(parents=True, exist_ok=True)
    if state.get("times"):  # the earlier calls' measured times, back into the fresh copy of the file
        times["cases"].update(state["times"])
        args.times.write_text(json.dumps(times, indent=1) + "\n")
    report = Report(args.out, args.mirror, extra=(args.times,))
    report.restore(state.get("section", []))
    f = facts()
    where = f"{f['count']} x {f['gpu']}"
    kept, dropped = fit(todo, times, args.budget_s - install_s - spent_before)

    def entry(c):
        return {
            "name": c.name,
            "part": c.part,
            "seconds": estimate(times, c.name)[0],
            "source": estimate(times, c.name)[1],
        }

    report.start(
        f,
        {
            "budget_s": args.budget_s,
            "install_s": install_s,
            "install_source": times["install"]["source"],
            "spent_before_s": spent_before,
            "cases_s": args.budget_s - install_s - spent_before,
        },
        [entry(c) for c in kept],
        [entry(c) for c in dropped],
        resumed=bool(state),
    )
    print(f"gpu-check: {where}; {len(kept)} case(s) planned, {len(dropped)} dropped", flush=True)
    status = check(
        kept, args.times, args.budget_s, install_s, report, args.work, where, spent_before, args.call_s, done=done
    )
    report.copy()
    return 0 if all(s in ("passed", "skipped") for s in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

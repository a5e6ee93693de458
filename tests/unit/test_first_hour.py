"""The first hour of a new user (issue 48): the default precision fits the CPU, MFU only
against a peak the launcher knows, `make plan` on a machine without GPUs plans for it;
item 9's small untruths: the plan's reserve and headroom, its chart and --json, what a
stop says of a relaunch and how soon, a sweep's point names.
(Data keys without their source and a CPU run that cannot fit: tests/unit/test_bad_input.py;
a relaunch that keeps the run's values: tests/e2e/test_run_dir_runs.py.)"""

from __future__ import annotations

import pytest

from launcher.host import HostInfo, native_bf16
from launcher.launch import cli
from launcher.launch.checks import asked
from launcher.launch.compose import compose_config

ZEN4 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_bf16 avx512_vnni\n"
SKYLAKE = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni\n"
SAPPHIRE = "flags\t\t: avx512f amx_tile amx_bf16 amx_int8\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
GRAVITON2 = "processor\t: 0\nFeatures\t: fp asimd asimddp\n"


@pytest.mark.parametrize(
    "cpuinfo,native",
    [(ZEN4, True), (SKYLAKE, False), (SAPPHIRE, True), (GRAVITON3, True), (GRAVITON2, False), ("", False)],
)
def test_native_bf16_from_the_cpu_flags(cpuinfo, native):
    assert native_bf16(cpuinfo) is native


def test_the_default_precision_is_fp32_on_a_cpu_without_native_bf16():
    """bf16 was emulated there: 1,052-1,235 tokens/s against 15,031 in fp32 (issue 48)."""
    cpu = HostInfo(cuda=False, gpus=0, cpus=2)
    cfg, _, _ = compose_config([])
    fitted, note = asked.fit_precision(cfg, asked.named([]), cpu, native=False)
    assert fitted.precision.name.value == "fp32" and "no native bf16" in note and "precision=bf16" in note
    for chosen in (["precision=bf16"], ["precision.name=bf16"], ["precision=fp8"]):  # asked for: kept
        cfg, _, _ = compose_config(chosen)
        assert asked.fit_precision(cfg, asked.named(chosen), cpu, native=False) == (cfg, None)
    cfg, _, _ = compose_config([])
    assert asked.fit_precision(cfg, set(), cpu, native=True) == (cfg, None)
    assert asked.fit_precision(cfg, set(), HostInfo(cuda=True, gpus=1, cpus=2), native=False) == (cfg, None)


def test_a_dry_run_on_this_machine_says_the_precision_once(tmp_path, capsys, monkeypatch):
    """`make train ARGS=--dry-run` with the default precision: this CPU's flags decide."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", f"hydra.run.dir={tmp_path / 'run'}", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    want = "bf16" if native_bf16() else "fp32"
    assert f"precision:\n  name: {want}\n" in out
    assert err.count("no native bf16") == (0 if native_bf16() else 1), err


def test_mfu_only_against_a_known_peak_and_never_above_one():
    import torch

    from launcher.device import peak_flops
    from launcher.rank.metrics import Throughput

    assert peak_flops(torch.device("cpu"), torch.bfloat16) == (None, None)  # a CPU: no peak known
    assert peak_flops(torch.device("cpu"), None, tflops=2.0) == (2e12, None)  # cluster.peak_tflops
    assert "mfu" not in Throughput(100, 1, 6e6, None, steps=1).rates()
    rates = Throughput(100, 1, 6e6, 1e12, steps=1, start=0.0).rates()  # a long interval: a small MFU
    assert 0 < rates["mfu"] < 1
    import time

    assert "mfu" not in Throughput(10**6, 1, 6e9, 1e9, steps=1, start=time.perf_counter() - 1).rates()  # 6000x


def test_make_plan_without_a_gpu_plans_for_this_machine(capsys):
    """No cluster named on a machine without GPUs: its CPU processes and memory (issue 48:
    it stopped at `cluster.gpus_per_node=None: needed to plan`)."""
    import os

    host = HostInfo.detect()
    if host.cuda:
        pytest.skip("a GPU machine plans for its GPUs")
    from launcher.launch.commands.plan import cmd_plan

    assert cmd_plan(["model=gpt_1b"]) == 0
    out = capsys.readouterr().out
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    assert f"this machine: 2 CPU process(es) sharing {ram:.0f} GiB" in out, out[:500]
    assert "zero2_offload" not in out and "recommended: make train" in out or "nothing fits" in out, out[-1500:]


@pytest.mark.parametrize(
    "recipe,cuda,want",
    [
        ("ddp", False, []),
        ("fsdp", True, []),
        ("zero2", True, []),
        ("zero2", False, ["ShareMemCommBuilder"]),
        ("zero2_offload", True, ["CPUAdamBuilder"]),
        ("zero3_offload", False, ["CPUAdamBuilder", "ShareMemCommBuilder"]),
    ],
)
def test_the_deepspeed_ops_a_run_compiles_first(recipe, cuda, want):
    """Set-up no longer compiles them (4.6 of its 7 minutes, issue 48): a launch compiles
    the ones its run loads, once per environment, before its ranks start."""
    from launcher import ops

    cfg, _, _ = compose_config([f"recipe={recipe}"])
    assert ops.needed(cfg, cuda) == want


def test_a_build_lock_left_by_a_killed_build_is_removed_and_a_live_one_kept(tmp_path, capsys):
    """torch takes <op folder>/lock for every load of a DeepSpeed op and waits for it without
    end: one build killed mid-way hung every later DeepSpeed run of the host, silently. The
    launch removes a lock older than ops.STALE_LOCK_S when no process works in the folder
    (a live build runs ninja there), and says so in one line."""
    import os
    import subprocess
    import time

    from torch.utils.file_baton import FileBaton

    from launcher import ops

    folder = tmp_path / "cpu_adam"
    folder.mkdir()
    lock = folder / "lock"
    lock.write_text("")
    assert not FileBaton(str(lock)).try_acquire()  # what a rank's load would wait on
    assert not ops.clear_stale_lock(str(folder)) and lock.exists()  # young: a build may have just begun
    old = time.time() - 2 * ops.STALE_LOCK_S
    os.utime(lock, (old, old))
    building = subprocess.Popen(["sleep", "60"], cwd=folder)  # stands where ninja would
    try:
        deadline = time.time() + 10
        while not ops.working_in(str(folder)) and time.time() < deadline:
            time.sleep(0.05)
        assert not ops.clear_stale_lock(str(folder)) and lock.exists()
    finally:
        building.kill()
        building.wait()
    assert ops.clear_stale_lock(str(folder)) and not lock.exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(lock) in err[0] and "interrupted build" in err[0]
    assert FileBaton(str(lock)).try_acquire()  # the next load builds or loads at once
    assert not ops.clear_stale_lock(str(folder / "absent"))


# ----------------------------------------------------------------------------- small untruths (issue 48, 9)
def png_size(path) -> tuple[int, int]:
    import struct

    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_make_plan_tells_the_reserve_and_its_headroom_agrees_with_the_marks(tmp_path):
    """`make plan` for Llama-3-8B on 8 x 24 GiB at seq 4096 (the issue's plan): rows marked ✗
    showed positive headroom, since a row fits only within GPU memory less plan.reserve_gb
    (2 GiB, said nowhere); `--json` had no recommended command; the chart was 4200 x 600."""
    import json

    from runs import here

    args = ["model=llama3_8b", "cluster.gpus_per_node=8", "cluster.gpu_memory_gb=24", "train.seq_len=4096"]
    chart = tmp_path / "plan.png"
    data = json.loads(here("plan", *args, "--json", f"plan.chart={chart}").stdout)
    assert data["reserve_bytes"] == 2 * 2**30 and data["per"] == "GPU"
    inside = [r for r in data["rows"] if 0 < data["gpu_bytes"] - r["peak"] < data["reserve_bytes"]]
    assert inside and not any(r["fits"] for r in inside)  # the rows the reserve alone refuses
    for r in data["rows"]:  # no host memory given: only the GPU decides
        assert r["headroom"] == data["gpu_bytes"] - data["reserve_bytes"] - r["peak"] and r["fits"] == (
            r["headroom"] >= 0
        )
    table = here("plan", *args).stdout
    marked = [line.split("│") for line in table.splitlines() if line.startswith("│ ✗")]
    assert marked and all(float(cells[13]) < 0 for cells in marked), marked[:3]
    caption = " ".join(table.split())
    assert "headroom = GPU memory less plan.reserve_gb (2 GiB held back" in caption, table[-1500:]
    line = next(x for x in table.splitlines() if x.startswith("recommended: "))
    assert data["recommended_command"] == line.removeprefix("recommended: ").strip()
    assert data["recommended_command"].startswith("make train RECIPE=")
    width, height = png_size(chart)  # one bar per layout (21 here), its labels horizontal
    assert 800 <= width <= 1600 and 600 <= height <= 1600, (width, height)


def test_a_plan_on_this_cpu_says_per_process():
    """Item 8's leftover: the plan for this machine's CPU processes said "GiB per GPU"."""
    from runs import here

    if HostInfo.detect().cuda:
        pytest.skip("a GPU machine plans for its GPUs")
    out = " ".join(here("plan", "model=gpt_tiny").stdout.split())
    assert "GiB per process." in out and "a process's share of this machine's memory less plan.reserve_gb" in out
    caption = out.split("GiB per process.", 1)[1].split("recommended:")[0]
    assert "GPU" not in caption, caption


def test_a_stop_says_what_a_relaunch_does(tmp_path, capsys):
    """No checkpoint: it said "no complete checkpoint yet. Launch the same run directory
    again to resume from it.", with nothing to resume (the launches: tests/e2e/test_signals.py)."""
    from launcher.launch.start.supervise import disk_report, explain

    (tmp_path / "preempted.json").write_text('{"step": null, "signal": "SIGINT"}')
    assert explain(1, tmp_path, tmp_path / "checkpoints") == 130
    assert capsys.readouterr().out.strip() == (
        "interrupted (Ctrl-C) before the first step; no complete checkpoint was written, so there is nothing to "
        "resume. Launch the same run directory again to start the run over."
    )
    assert disk_report(tmp_path / "checkpoints", "no space left on device").endswith(
        "nothing to resume. Free space (or choose another checkpoint.dir), then launch the same run directory again "
        "to start the run over."
    )


def test_ctrl_c_says_how_long_the_step_takes(tmp_path, capfd):
    """The first Ctrl-C said "finish this step (within about a second)" when a step takes
    minutes: now from the last step time rank 0 logged. The supervisor runs as `make train`
    runs it, over a child that stands in for torchrun (a 150 s step does not run here; the
    tiny model's 'about a second': tests/e2e/test_signals.py)."""
    import json
    import os
    import signal
    import sys
    import threading

    from launcher.launch.start.supervise import AGREE_S, stop_line, supervise
    from launcher.rank.preempt import CHECK_S

    assert AGREE_S == CHECK_S
    assert stop_line(tmp_path) == "Ctrl-C: the ranks finish this step, save and stop (Ctrl-C again to stop at once)"
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "step_time_s": t}) + "\n" for s, t in ((1, 0.02), (2, 150.0)))
    )
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    assert supervise([sys.executable, "-c", "import time; time.sleep(2)"], dict(os.environ), tmp_path) == 0
    assert capfd.readouterr().err.strip() == (
        "Ctrl-C: the ranks finish this step (within about 2m31s: the last step "
        "took 2m30s), save and stop (Ctrl-C again to stop at once)"
    )


def test_a_sweep_names_its_points_by_their_values(tmp_path, capsys, monkeypatch):
    """`make train ARGS="-m ..."` named its points `run 0`, `run 1` (the launch and its
    comparison table: tests/e2e/test_sweep_runs.py)."""
    from launcher.launch.commands.sweep import point_names

    points = [
        ["optim.lr=0.001", "model=gpt_tiny", "train.steps=2"],
        ["optim.lr=0.001", "model=gpt_small", "train.steps=2"],
        ["optim.lr=0.003", "model=gpt_tiny", "train.steps=2"],
    ]
    assert point_names(points) == [
        "optim.lr=0.001 model=gpt_tiny",
        "optim.lr=0.001 model=gpt_small",
        "optim.lr=0.003 model=gpt_tiny",
    ]
    assert point_names([["optim.lr=0.001"]]) == [""]
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "-m", "optim.lr=1e-3,2e-3", "--dry-run", f"hydra.sweep.dir={tmp_path / 's'}"]) == 0
    out = capsys.readouterr().out
    assert "# sweep point 1/2: optim.lr=0.001\n" in out and "# sweep point 2/2: optim.lr=0.002\n" in out
    assert "\nrun_name: optim.lr=0.001\n" in out and "\nrun_name: optim.lr=0.002\n" in out
    assert (
        cli.main(
            ["train", "-m", "optim.lr=1e-3,2e-3", "run_name=mine", "--dry-run", f"hydra.sweep.dir={tmp_path / 's'}"]
        )
        == 0
    )
    assert capsys.readouterr().out.count("\nrun_name: mine\n") == 2  # the user's own name is kept

"""make gpu-check's plan, rehearsed on CPU (issue 51, item 1): the dry-run's case order and
planned memory, the budget dropping the lowest-priority cases first, and the results written
as each case ends, so that a failed case, one stopped by the clock and one never started all
leave bench/gpu.md holding what came before. No GPU here: the cases run by the check in the
last tests are stand-ins (a function, `sh -c 'exit 3'`, `sleep`), through the real runner."""

from __future__ import annotations

import json
import sys
import time

import psutil
import pytest
from runs import REPO

sys.path.insert(0, str(REPO / "scripts"))
import gpu_cases  # noqa: E402
import gpu_check  # noqa: E402
from gpu_report import Report  # noqa: E402


def dry_run_json(capsys, *args: str) -> dict:
    assert gpu_check.main(["--dry-run", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_cases_come_in_priority_order(capsys):
    """Each part's first case (a-f, the issue's order), then the others in part order, then
    the standing test set; every name once; the times file has a figure for each."""
    rows = dry_run_json(capsys, "--no-memory")["cases"]
    names, parts = [r["name"] for r in rows], [r["part"] for r in rows]
    assert (
        parts[:6] == list("abcdef") and parts[6:-1] == sorted(parts[6:-1]) and parts[-1] == "g"
    )  # the standing set last
    assert names[:2] == ["a-bf16", "b-fsdp-gpt_350m"] and "a-fp16" in names[6:]
    assert len(set(names)) == len(names) == len(gpu_cases.cases())
    times = json.loads((REPO / "bench" / "gpu_times.json").read_text())
    assert set(times["cases"]) == set(names)
    assert all(not r["source"].startswith("estimate: no figure") for r in rows)


def test_the_budget_drops_the_lowest_priority_cases_first(capsys):
    full = dry_run_json(capsys, "--no-memory", "--budget-s", "100000")
    assert all(r["kept"] for r in full["cases"])
    for budget in (720, 400, 200):
        out = dry_run_json(capsys, "--no-memory", "--budget-s", str(budget))
        kept = [r["kept"] for r in out["cases"]]
        assert kept == sorted(kept, reverse=True), kept  # a prefix kept, the rest (the lowest) dropped
        used = sum(r["seconds"] for r in out["cases"] if r["kept"]) + out["install_s"]
        first_dropped = next((r for r in out["cases"] if not r["kept"]), None)
        assert used <= budget and (first_dropped is None or used + first_dropped["seconds"] > budget)
    assert not any(r["kept"] for r in dry_run_json(capsys, "--no-memory", "--budget-s", "20")["cases"])


def test_the_dry_run_plans_each_runs_memory(capsys):
    """The planner's figures per run: context parallel's cp=2 holds less than cp=1 per rank."""
    (case,) = dry_run_json(capsys, "--cases", "d-context-parallel")["cases"]
    cp1, cp2 = case["runs"]["cp1"], case["runs"]["cp2"]
    assert 0 < cp2["peak"] < cp1["peak"] and case["max_peak"] == cp1["peak"]


def test_a_wrong_case_name_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_check.main(["--dry-run", "--cases", "a-bf16,nope"])
    assert exc.value.code == 2 and "--cases nope: not a case" in capsys.readouterr().err


# Outlives the budget, with a child in a session of its own (as the launcher starts torchrun).
SLOW = (
    "import pathlib, subprocess, time; p = subprocess.Popen(['sleep', '60'], start_new_session=True); "
    "pathlib.Path('{}').write_text(str(p.pid)); time.sleep(60)"
)


def test_results_are_appended_as_each_case_ends(tmp_path):
    """Four stand-ins through the real runner, 4 s of budget: one passes, one fails (and
    finds the first one's section on disk already), one outlives the budget and is stopped
    with the process it started in another session, one is never started. The file keeps
    what it held, each case's section lands in order, the times file gets their seconds,
    the state names every case."""
    out, times = tmp_path / "gpu.md", tmp_path / "gpu_times.json"
    out.write_text("# GPU check\n\nearlier results\n")
    times.write_text(
        json.dumps(
            {
                "install": {"seconds": 0, "source": "test"},
                "cases": {n: {"seconds": 1, "source": "estimate: test"} for n in ("ok", "fails", "slow")}
                | {"late": {"seconds": 60, "source": "estimate: test"}},
            }
        )
    )
    seen = {}

    def passes(left, folder):
        (folder / "measured").mkdir()
        (folder / "measured" / "x.json").write_text(
            json.dumps({"table": {"title": "Stand-in", "columns": ["k", "v"], "row": ["x", 1]}})
        )
        return "passed", ""

    def fails(left, folder):  # by then the first case's section is on disk
        seen["at fails"] = out.read_text()
        return gpu_check.run_case(gpu_cases.Case("fails", "x", "", ["sh", "-c", "echo boom; exit 3"]), left, folder)

    cases = [
        gpu_cases.Case("ok", "a", "passes", passes),
        gpu_cases.Case("fails", "b", "fails", fails),
        gpu_cases.Case("slow", "c", "sleeps past the budget", [sys.executable, "-c", SLOW.format(tmp_path / "pid")]),
        gpu_cases.Case("late", "d", "never fits", ["true"]),
    ]
    report = Report(out, mirror=tmp_path / "mirror", extra=(times,))
    t0 = time.monotonic()
    done = gpu_check.check(cases, times, budget_s=4, install_s=0, report=report, work=tmp_path / "work", where="test")
    assert time.monotonic() - t0 < 12
    child = int((tmp_path / "pid").read_text())
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    assert done["ok"] == "passed" and done["fails"] == "failed (exit 3)"
    assert done["slow"] == "stopped at the budget" and done["late"] == "skipped"
    text = out.read_text()
    assert text.startswith("# GPU check\n\nearlier results\n")
    assert "### `ok`: passed" in seen["at fails"] and "### `fails`" not in seen["at fails"]
    order = [
        text.index(s)
        for s in (
            "### `ok`: passed",
            "| x | 1 |",
            "### `fails`: failed (exit 3)",
            "boom",
            "### `slow`: stopped at the budget",
            "Not started: `late` (needs about 60 s",
        )
    ]
    assert order == sorted(order)
    assert (tmp_path / "mirror" / "gpu.md").read_text() == text
    recorded = json.loads(times.read_text())["cases"]
    assert recorded["ok"]["source"].startswith("measured") and 2 <= recorded["slow"]["seconds"] <= 6
    assert "at least" in recorded["slow"]["source"] and recorded["late"]["source"] == "estimate: test"
    state = json.loads((tmp_path / "work" / "state.json").read_text())
    assert state["done"] == done and "".join(state["section"]) in text and state["times"] == recorded


def test_a_resumed_check_puts_back_what_the_file_lost(tmp_path):
    """The device tool copies the working tree afresh each call: the second call appends the
    first call's part again before its own."""
    out = tmp_path / "gpu.md"
    out.write_text("# GPU check\n")
    first = Report(out)
    first.append(["", "### `a-bf16`: passed"])
    out.write_text("# GPU check\n")  # the next call's fresh copy
    second = Report(out)
    second.restore(first.written)
    second.restore(first.written)  # only once
    second.append(["", "### `b-fsdp-gpt_350m`: passed"])
    assert out.read_text() == "# GPU check\n\n### `a-bf16`: passed\n\n### `b-fsdp-gpt_350m`: passed\n"


def test_a_pytest_case_reports_its_tests(tmp_path):
    """A real case of the list, as the check starts it (pytest -m gpu on a tests/gpu file, its
    junit into the case's folder): here, without CUDA, its test is skipped and says why."""
    (case,) = [c for c in gpu_cases.cases() if c.name == "g-standing-set"]
    case.argv = [a for a in case.argv if a != "tests/gpu/test_gpu.py"]  # the shorter file of the two
    out, times = tmp_path / "gpu.md", tmp_path / "gpu_times.json"
    times.write_text(json.dumps({"install": {"seconds": 0, "source": "test"}, "cases": {}}))
    done = gpu_check.check(
        [case], times, budget_s=600, install_s=0, report=Report(out), work=tmp_path / "work", where="test"
    )
    assert done == {"g-standing-set": "passed"}
    text = out.read_text()
    assert "### `g-standing-set`: passed" in text and "1 skipped." in text
    assert "| test_flex_attention_trains_as_the_dense_mask_and_as_the_samples_alone | skipped: no CUDA GPU |" in text

"""Writing metrics never ends a run: a metrics.jsonl row or summary.json that cannot be
written (/dev/full) is said once. W&B with a key and no route: tests/e2e/test_wandb_offline_runs.py."""

from __future__ import annotations


def test_a_metrics_row_or_summary_that_cannot_be_written_is_said_once(tmp_path, capfd):
    """A full disk under metrics.jsonl (its open file's descriptor pointed at /dev/full, which
    fails every write with ENOSPC) and under summary.json (a link to /dev/full): one line
    each on stderr, however many rows follow, and the logger goes on."""
    import json
    import os

    from launcher.launch import cli
    from launcher.rank.metrics import STEP_METRICS, RankZeroLogger

    cfg, _, _ = cli.compose_config(["logger=none"])
    log = RankZeroLogger(cfg, tmp_path, rank=0, total_steps=5, start_step=0)
    row = {k: 1.0 for k in STEP_METRICS}
    log.log({**row, "step": 1})
    full = os.open("/dev/full", os.O_WRONLY)
    os.dup2(full, log.jsonl.fileno())  # the disk under metrics.jsonl fills
    os.close(full)
    for step in range(2, 6):
        log.log({**row, "step": step})
    (tmp_path / "summary.json").symlink_to("/dev/full")
    log.finish({"steps": 5, "loss": 1.0})
    out, err = capfd.readouterr()
    said = [line for line in err.splitlines() if line.strip()]
    assert said == [
        "metrics.jsonl: No space left on device; later rows go to the console only",
        "summary.json: No space left on device; the summary above is the run's record",
    ], err
    assert all(f"step {s:>6}" in out for s in range(1, 6))  # every row still on the console
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]

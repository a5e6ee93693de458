"""Logging never ends a run: with a W&B key set and no route to the server (a closed port
on this machine), `logger.mode=auto` trains and logs offline, `logger.mode=online` is
refused at launch, and a rank whose online start fails falls back to offline files."""

from __future__ import annotations

import socket
import time

import pytest
import yaml
from runs import FAST, REPO, launch
from wandb_file import records


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the socket is: connections are refused


@pytest.fixture
def blackhole():
    """A port on this machine that never answers: its listen queue is full, so the kernel
    drops further connection attempts and a client waits out its own timeout (as with a
    firewall that drops packets, the usual case on compute nodes)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = srv.getsockname()[1]
    fill = []
    for _ in range(3):
        c = socket.socket()
        c.setblocking(False)
        try:
            c.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        fill.append(c)
    yield port
    for c in fill + [srv]:
        c.close()


def no_route(tmp_path) -> dict:
    return {
        "WANDB_API_KEY": "x" * 40,
        "WANDB_BASE_URL": f"http://127.0.0.1:{closed_port()}",
        "WANDB_DIR": str(tmp_path),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
    }


@pytest.mark.slow
def test_a_key_without_a_route_logs_offline_and_online_is_refused(tmp_path):
    env = no_route(tmp_path)
    run = tmp_path / "run"
    fast = [o for o in FAST if not o.startswith("logger.mode")]
    proc = launch("logger=wandb", "logger.mode=auto", *fast, "train.steps=3", run_dir=run, env=env, timeout=240)
    line = [x for x in proc.stdout.splitlines() if x.startswith("W&B:")]
    assert len(line) == 1 and "cannot reach the W&B server" in line[0] and "logs offline" in line[0], proc.stdout
    assert yaml.safe_load((run / "config.yaml").read_text())["logger"]["mode"] == "offline"
    run_file = next((run / "wandb").glob("offline-run-*/run-*.wandb"))
    logged = [r for r in records(run_file) if r.WhichOneof("record_type") == "history"]
    assert len(logged) == 3

    refused = launch("logger=wandb", "logger.mode=online", *fast, run_dir=tmp_path / "online", env=env, check=False)
    assert refused.returncode == 2, refused.stderr[-2000:]
    lines = [x for x in refused.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "logger.mode=online" in lines[0] and "cannot reach" in lines[0], lines
    assert not (tmp_path / "online").exists()


@pytest.mark.slow
def test_a_rank_whose_online_start_fails_logs_offline(tmp_path, monkeypatch, capsys):
    """The ranks' own fallback (a Slurm job's compute nodes are checked by nobody)."""
    from launcher.launch import cli
    from launcher.rank import metrics

    for k, v in no_route(tmp_path).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(metrics, "WANDB_INIT_TIMEOUT_S", 5)
    cfg, _, _ = cli.compose_config(["logger=wandb", "logger.mode=online"])
    run = tmp_path / "run"
    run.mkdir()
    wandb_run = metrics._init_wandb(cfg, run)
    assert wandb_run is not None and wandb_run.settings.mode == "offline"
    wandb_run.log({"loss": 1.0}, step=1)
    wandb_run.finish()
    assert "logging offline" in capsys.readouterr().err
    assert next((run / "wandb").glob("offline-run-*/run-*.wandb")).stat().st_size > 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["offline", "online"])
def test_a_rank_whose_wandb_cannot_start_at_all_trains_without_it(mode, tmp_path, monkeypatch, capsys):
    """Not even offline files can be written (RUN_DIR/wandb is a file here; a read-only or
    full disk in real life): one line, and the rank goes on without W&B."""
    from launcher.launch import cli
    from launcher.rank import metrics

    for k, v in no_route(tmp_path).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(metrics, "WANDB_INIT_TIMEOUT_S", 5)
    cfg, _, _ = cli.compose_config(["logger=wandb", f"logger.mode={mode}"])
    run = tmp_path / "run"
    run.mkdir()
    (run / "wandb").write_text("not a folder\n")
    assert metrics._init_wandb(cfg, run) is None
    # ours only: W&B's own "wandb: ... Loaded credentials" line comes with any online start
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and not line.startswith("wandb: ")]
    if mode == "offline":
        assert len(err) == 1 and err[0].startswith("W&B could not start (") and "goes on without W&B" in err[0], err
    else:  # online fails (no route), then offline too: a line for each
        assert len(err) == 2 and "logging offline" in err[0], err
        assert err[1].startswith("W&B could not start offline either (") and "goes on without W&B" in err[1], err


@pytest.mark.slow
def test_waits_for_a_server_that_never_answers_are_bounded(blackhole, tmp_path, monkeypatch, capsys):
    """The launch side's probe gives up after 5 s; a rank's online start after
    WANDB_INIT_TIMEOUT_S (30 s; 4 s here), then logs offline."""
    import inspect

    from launcher.launch import cli
    from launcher.rank import metrics

    assert (
        metrics.WANDB_INIT_TIMEOUT_S == 30
        and inspect.signature(metrics.wandb_unreachable).parameters["timeout_s"].default == 5.0
    )  # the bounds docs/reliability.md gives

    env = {**no_route(tmp_path), "WANDB_BASE_URL": f"http://127.0.0.1:{blackhole}"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    t0 = time.monotonic()
    why = metrics.wandb_unreachable()
    assert why and "cannot reach the W&B server" in why and "timed out" in why, why
    assert 5 <= time.monotonic() - t0 < 8
    monkeypatch.setattr(metrics, "WANDB_INIT_TIMEOUT_S", 4)
    cfg, _, _ = cli.compose_config(["logger=wandb", "logger.mode=online"])
    run = tmp_path / "run"
    run.mkdir()
    t0 = time.monotonic()
    wandb_run = metrics._init_wandb(cfg, run)
    took = time.monotonic() - t0
    assert wandb_run is not None and wandb_run.settings.mode == "offline"
    wandb_run.finish()
    assert "logging offline" in capsys.readouterr().err
    assert 4 <= took < 4 + 20, took  # the bound, plus starting W&B's service twice


@pytest.mark.slow
def test_a_rank_starts_its_own_wandb_service_not_the_one_its_parent_names(tmp_path):
    """What failed a relaunch on CI: a process that runs W&B (a test's; a notebook or a
    sweep agent in real life) exports WANDB_SERVICE, and a rank started under it joined
    that service, where a killed launch's run still held the run id ("run ID ... is in
    use"). A rank 0 starts its own service, so the relaunch resumes the id in its own file.
    Both are fresh processes: the parent holds the run open while its child starts."""
    import os
    import subprocess
    import sys

    start = (
        "from pathlib import Path; from launcher.launch import cli; from launcher.rank import metrics; "
        "cfg, _, _ = cli.compose_config(['logger=wandb', 'logger.mode=offline', 'logger.system_metrics_s=0']); "
        f"r = metrics._init_wandb(cfg, Path({str(tmp_path / 'run')!r})); "
    )
    child = start + "r.log({'loss': 1.0}, step=1); r.finish()"
    parent = start + (  # never finished while the child starts: its service holds the run id
        "import os, subprocess, sys; assert os.environ['WANDB_SERVICE']; "
        f"c = subprocess.run([sys.executable, '-c', {child!r}], capture_output=True, text=True, timeout=240); "
        "r.finish(); sys.stderr.write(c.stderr); sys.exit(c.returncode)"
    )
    (tmp_path / "run").mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", parent],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "WANDB_DIR": str(tmp_path), "WANDB_SERVICE": ""},
    )
    assert proc.returncode == 0 and "could not start" not in proc.stderr, proc.stderr[-3000:]
    runs = sorted((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 2 and len({p.name for p in runs}) == 1, runs  # two starts, one run id

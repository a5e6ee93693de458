"""Logging never ends a run: with a W&B key set and no route to the server (a closed port
on this machine), `logger.mode=auto` trains and logs offline, `logger.mode=online` is
refused at launch, and a rank whose online start fails falls back to offline files."""

from __future__ import annotations

import socket

import pytest
import yaml

from conftest import FAST, launch
from wandb_file import records


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the socket is: connections are refused


def no_route(tmp_path) -> dict:
    return {"WANDB_API_KEY": "x" * 40, "WANDB_BASE_URL": f"http://127.0.0.1:{closed_port()}",
            "WANDB_DIR": str(tmp_path), "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config")}


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
    from launcher import cli, metrics

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

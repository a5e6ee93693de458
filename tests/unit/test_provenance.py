"""Provenance (launcher/provenance.py): the record every launch writes, against a real git
checkout made here; the Slurm job's copy of the code (cluster.snapshot_code) as the
submitted script names it. The e2e runs read the same records back from real launches
(test_train's default run, test_slurm_runs' job)."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from runs import REPO

from launcher import provenance
from launcher.launch import cli
from launcher.launch.submit import slurm


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


@pytest.fixture
def checkout(tmp_path, monkeypatch) -> Path:
    """A git checkout with one commit, one tracked change and one new file, as the project."""
    repo = tmp_path / "project"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "train.py").write_text("lr = 3e-4\n")
    _git(repo, "add", "train.py")
    _git(repo, "commit", "-q", "-m", "first")
    (repo / "train.py").write_text("lr = 1e-3\n")
    (repo / "notes.txt").write_text("new\n")
    monkeypatch.setattr(provenance, "PROJECT", repo)
    return repo


def test_a_launch_records_the_commit_its_changes_the_packages_and_the_command(checkout, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    folder = provenance.write(run_dir, ["train", "model=gpt_tiny", "optim.lr=1e-3"], 0)
    rec = json.loads((folder / "provenance.json").read_text())
    assert rec["git"]["commit"] == _git(checkout, "rev-parse", "HEAD").strip()
    assert rec["git"]["dirty"] is True and rec["git"]["untracked"] == ["notes.txt"]
    assert "-lr = 3e-4" in (folder / "git.diff").read_text() and "+lr = 1e-3" in (folder / "git.diff").read_text()
    assert rec["command"].endswith("-m launcher train model=gpt_tiny optim.lr=1e-3")
    assert rec["versions"]["torch"] == metadata.version("torch")
    assert rec["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert f"torch=={metadata.version('torch')}" in (folder / "requirements.txt").read_text().splitlines()
    assert json.loads((run_dir / provenance.LATEST).read_text()) == rec  # what W&B's config reads
    # A second launch within the same second keeps the first record.
    again = provenance.write(run_dir, ["train"], 0)
    assert again != folder and (folder / "provenance.json").exists()
    assert json.loads((run_dir / provenance.LATEST).read_text())["folder"] == str(again.relative_to(run_dir))


def test_a_clean_checkout_has_no_diff_and_a_copy_without_git_says_why(checkout, tmp_path, monkeypatch):
    _git(checkout, "add", "-A")
    _git(checkout, "commit", "-q", "-m", "second")
    folder = provenance.write(tmp_path, ["train"], 0)
    assert json.loads((folder / "provenance.json").read_text())["git"]["dirty"] is False
    assert not (folder / "git.diff").exists()
    plain = tmp_path / "unpacked"
    plain.mkdir()
    monkeypatch.setattr(provenance, "PROJECT", plain)
    folder = provenance.write(tmp_path / "other", ["train"], 1)  # node 1 of a launch by hand
    assert "no git state" in json.loads((folder / "provenance.json").read_text())["git"]["error"]
    assert not (tmp_path / "other" / provenance.LATEST).exists(), "only node 0 writes the run's latest record"


def test_the_wandb_summary_carries_the_commit_and_the_ranks_hosts(checkout, tmp_path):
    provenance.write(tmp_path, ["submit", "cluster.nnodes=2"], 0, code=tmp_path / "code")
    (tmp_path / provenance.FOLDER / provenance.HOSTS).write_text(
        json.dumps({"hosts": {"node-a": [0, 1], "node-b": [2, 3]}, "versions": {"nccl": "2.28.9"}}) + "\n"
    )
    short = provenance.for_wandb(tmp_path)
    assert short["commit"] == _git(checkout, "rev-parse", "HEAD").strip() and short["dirty"] is True
    assert short["code"] == str(tmp_path / "code") and short["rank_hosts"]["node-b"] == [2, 3]
    assert short["rank_versions"] == {"nccl": "2.28.9"}
    assert provenance.for_wandb(tmp_path / "nothing") is None


def _dry_run(capsys, run_dir: Path, *more: str) -> str:
    assert (
        cli.main(
            [
                "submit",
                "recipe=ddp",
                "cluster=slurm",
                "cluster.nnodes=2",
                f"hydra.run.dir={run_dir}",
                *more,
                "--dry-run",
            ]
        )
        == 0
    )
    return capsys.readouterr().out


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the snapshot needs PYTHONSAFEPATH (Python 3.11+)")
def test_a_job_imports_its_snapshot_unless_told_not_to(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    script = _dry_run(capsys, tmp_path / "run")
    assert f"export PYTHONPATH={tmp_path / 'run' / 'code'}\n" in script and "export PYTHONSAFEPATH=1\n" in script
    script = _dry_run(capsys, tmp_path / "run", "+cluster.env.PYTHONPATH=/site/extra")
    assert f"export PYTHONPATH={tmp_path / 'run' / 'code'}:/site/extra\n" in script
    script = _dry_run(capsys, tmp_path / "run", "cluster.snapshot_code=false")
    assert "PYTHONPATH" not in script and "PYTHONSAFEPATH" not in script


def test_the_snapshot_holds_the_packages_and_a_new_one_replaces_it_whole(tmp_path):
    code = slurm.snapshot_code(tmp_path)
    for name in slurm.PACKAGES:
        assert (code / name / "__init__.py").read_text() == (REPO / name / "__init__.py").read_text()
    assert not list(code.rglob("__pycache__"))
    (code / "launcher" / "stale.py").write_text("x = 1\n")
    assert slurm.snapshot_code(tmp_path) == code and not (code / "launcher" / "stale.py").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["code"]


def test_a_line_cut_short_neither_hides_the_ranks_nor_swallows_the_next_start(one_rank_group, checkout, tmp_path):
    """hosts.jsonl is appended at every start of the ranks; a kill or a full disk can cut a
    line. The next start writes on a line of its own, and W&B's summary reads the last whole one."""
    provenance.write(tmp_path, ["train"], 0)
    hosts = tmp_path / provenance.FOLDER / provenance.HOSTS
    hosts.write_text(json.dumps({"hosts": {"old": [0]}}) + "\n" + '{"hosts": {"cut')
    assert provenance.for_wandb(tmp_path)["rank_hosts"] == {"old": [0]}
    provenance.record_hosts(tmp_path, 0, 1)
    last = json.loads(hosts.read_text().splitlines()[-1])
    assert (
        list(last["hosts"].values()) == [[0]] and last["git"]["commit"] == _git(checkout, "rev-parse", "HEAD").strip()
    )
    assert provenance.for_wandb(tmp_path)["rank_git"]["dirty"] is True

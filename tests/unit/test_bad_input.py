"""Bad input: one line naming the key, the value and what is allowed; exit code 2; no
traceback; no rank started and no run directory made. The table: tests/helpers/bad_inputs.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from bad_inputs import CASES, CHAT, HF, MOE, TOK, W
from runs import REPO

from launcher.launch import cli


def case_id(overrides: list[str]) -> str:
    """The same on every collection (pytest-xdist's workers compare them): the session's
    temporary folders by name."""
    text = " ".join(overrides)
    for name, folder in {
        "<hf>": next(iter(HF.values())).parent,
        "<weights>": next(iter(W.values())).parent,
        "<chat>": next(iter(CHAT.values())).parent,
        "<tok>": TOK,
        "<moe>": next(iter(MOE.values())).parent,
    }.items():
        text = text.replace(str(folder), name)
    return text


@pytest.mark.parametrize("overrides,words", CASES, ids=[case_id(c[0]) for c in CASES])
def test_bad_input_is_one_line_and_exit_2(overrides, words, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = list(overrides)
    if not any(o.startswith("hydra.run.dir") for o in overrides) and overrides[0] != "frobnicate":
        argv.append(f"hydra.run.dir={tmp_path / 'run'}")
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 2, f"exit {code}; stderr={err!r}"
    lines = err.strip().splitlines()  # no warning either: they wait until nothing can refuse the launch
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for w in words:
        assert w in lines[0], f"{w!r} not in {lines[0]!r}"
    assert "Traceback" not in err + out
    assert not (tmp_path / "run").exists(), "a run directory was made for bad input"
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize(
    "overrides",
    [
        ["recipe=nope"],
        ["train.steps=abc"],
        ["precision=fp16"],
        ["recipe=zero2", "+recipe.zero.extra.train_batch_size=64"],
        [
            "rehearse",
            "model=llama3_405b",
            "recipe=pp",
            "parallel.pp=16",
            "parallel.pp_microbatches=16",
            "cluster.gpus_per_node=8",
        ],
    ],
)
def test_bad_input_from_a_real_process(overrides, tmp_path):
    """The same through `python -m launcher`: exit code 2 from the launcher process itself."""
    command = ["rehearse"] if overrides[0] == "rehearse" else ["train"]
    overrides = overrides[len(command) :] if overrides[0] == "rehearse" else overrides
    proc = subprocess.run(
        [sys.executable, "-m", "launcher", *command, f"hydra.run.dir={tmp_path / 'run'}", *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", ["many", "0", "-2"])
def test_a_bad_omp_num_threads_is_refused_before_any_rank(value, tmp_path):
    """The launching shell's OMP_NUM_THREADS becomes each rank's threads: a value that is not
    a positive integer is refused in one line by the launcher process."""
    proc = subprocess.run(
        [sys.executable, "-m", "launcher", "train", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": value},
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: OMP_NUM_THREADS={value}: a positive integer (threads per rank), "
        "or unset it (then cluster.cpu_threads, else cores / processes)"
    ]
    assert not (tmp_path / "run").exists()


def test_runner_accelerate_where_accelerate_cannot_be_imported(tmp_path, capsys, monkeypatch):
    """An environment without accelerate (a None in sys.modules is how Python itself says a
    module cannot be imported; the launcher looks it up without importing it): one line, exit 2."""
    monkeypatch.setitem(sys.modules, "accelerate", None)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "cluster.runner=accelerate", f"hydra.run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cluster.runner=accelerate: accelerate is not installed for "), (
        err
    )
    assert "cluster.runner=torchrun" in err[0] and not (tmp_path / "run").exists()


def test_at_least_thirty_cases():
    assert len(CASES) >= 30


def test_node_0_with_an_address_that_is_not_its_own_is_refused_at_once(tmp_path, capsys, monkeypatch):
    """Node 0 hosts the rendezvous at cluster.master_addr: a name that resolves to another
    machine (here made so by the resolver, for a name under .invalid; the check only binds,
    it sends nothing) is refused before anything starts, not after the join timeout."""
    import socket

    real = socket.getaddrinfo

    def resolve(host, *args, **kwargs):
        if host == "node0.invalid":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("192.0.2.10", 29400))]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    monkeypatch.chdir(tmp_path)
    code = cli.main(
        [
            "train",
            "cluster.nnodes=2",
            "cluster.master_port=29400",
            "cluster.master_addr=node0.invalid",
            f"hydra.run.dir={tmp_path / 'run'}",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "cluster.master_addr=node0.invalid: resolves to 192.0.2.10, none of which is this machine's" in err[0]
    assert not (tmp_path / "run").exists()


def test_a_ctrl_c_while_the_launch_side_imports_is_held_then_said(tmp_path, capsys, monkeypatch):
    """A Ctrl-C that lands while validation runs (where the launch side imports torch, the
    engines, DeepSpeed lazily) does not interrupt it there, where a library's bare `except:`
    could swallow it; it is raised when validation ends: one line, exit 130, nothing written."""
    import os
    import signal

    from launcher.launch.checks import validate as V

    real, finished = V.validate, []

    def validate(cfg, host):
        os.kill(os.getpid(), signal.SIGINT)  # delivered here, in the middle of validation
        notes = real(cfg, host)
        finished.append(True)
        return notes

    monkeypatch.setattr(cli, "validate", validate)
    run = tmp_path / "run"
    before = signal.getsignal(signal.SIGINT)  # Python's handler; SIG_IGN under a shell's `cmd &` or nohup
    code = cli.main(["train", f"hydra.run.dir={run}"])
    out, err = capsys.readouterr()
    assert finished == [True] and code == 130, (code, err)
    assert err == "interrupted (Ctrl-C) before training started\n" and not run.exists(), err
    assert signal.getsignal(signal.SIGINT) is before  # the launcher's own handler is gone again

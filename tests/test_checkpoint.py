"""Checkpoint folder scheme: atomic rename, `latest`, keep-last-K, manifest checks.
Runs in one real gloo process group of size 1."""

from __future__ import annotations

import os
import pickle
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from launcher.checkpoint import Checkpointer, find_latest, read_latest, run_of, verify


class TinyEngine:
    def __init__(self, value: float):
        self.w = torch.full((4,), value)

    def save(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        torch.save({"w": self.w}, path / "model.pt")

    def load(self, path: Path) -> None:
        self.w = torch.load(path / "model.pt", weights_only=True)["w"]


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_save_keeps_the_newest_k_and_points_latest(tmp_path):
    ck = Checkpointer(tmp_path, keep=2, rank=0, world_size=1)
    for step in (10, 20, 30):
        ck.save(step, step * 8, TinyEngine(step))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["latest", "step_00000020", "step_00000030"]
    assert (tmp_path / "latest").read_text().strip() == "step_00000030"  # no run id: a hand-made Checkpointer
    engine = TinyEngine(0)
    state = ck.load(ck.resolve("auto"), engine)
    assert state.step == 30 and state.samples_seen == 240 and engine.w[0] == 30


def test_a_leftover_tmp_folder_is_never_read_and_is_cleaned(tmp_path):
    ck = Checkpointer(tmp_path, keep=3, rank=0, world_size=1)
    ck.save(10, 80, TinyEngine(10))
    (tmp_path / "step_00000020.tmp" / "engine").mkdir(parents=True)  # a save killed half-way
    assert find_latest(tmp_path).name == "step_00000010"
    ck.save(30, 240, TinyEngine(30))
    assert not list(tmp_path.glob("*.tmp"))


def test_a_corrupt_checkpoint_is_skipped_for_the_one_before(tmp_path):
    ck = Checkpointer(tmp_path, keep=3, rank=0, world_size=1)
    ck.save(10, 80, TinyEngine(10))
    ck.save(20, 160, TinyEngine(20))
    model = tmp_path / "step_00000020" / "engine" / "model.pt"
    data = bytearray(model.read_bytes())
    data[-20] ^= 0xFF  # same size, one flipped byte
    model.write_bytes(bytes(data))
    assert "sha256" in verify(tmp_path / "step_00000020")
    with pytest.warns(UserWarning, match="step_00000020 skipped"):
        assert find_latest(tmp_path).name == "step_00000010"


def test_resume_never_and_explicit_path(tmp_path):
    ck = Checkpointer(tmp_path, keep=3, rank=0, world_size=1)
    ck.save(10, 80, TinyEngine(10))
    ck.save(20, 160, TinyEngine(20))
    assert ck.resolve("never") is None
    assert ck.resolve(str(tmp_path / "step_00000010")).name == "step_00000010"


def test_a_run_only_resumes_and_deletes_its_own_checkpoints(tmp_path):
    """Two runs' checkpoints in one folder (a folder the launch side would have refused):
    keep-K of run b never deletes run a's, resume takes b's newest although a's is newer,
    a save at a step where a's checkpoint is keeps a's under another name."""
    a = Checkpointer(tmp_path, keep=2, rank=0, world_size=1, run_id="a")
    for step in (10, 20, 50):
        a.save(step, step, TinyEngine(step))
    b = Checkpointer(tmp_path, keep=2, rank=0, world_size=1, run_id="b")
    for step in (5, 15, 25):
        b.save(step, step, TinyEngine(100 + step))
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_"))
    assert names == ["step_00000015", "step_00000020", "step_00000025", "step_00000050"]
    assert [run_of(tmp_path / n) for n in names] == ["b", "a", "b", "a"]
    assert read_latest(tmp_path) == ("step_00000025", "b")
    engine = TinyEngine(0)
    assert b.load(b.resolve("auto"), engine).step == 25 and engine.w[0] == 125
    assert b.resolve("never").name == "step_00000025"  # its own lineage first: a relaunch of b
    b.save(50, 50, TinyEngine(150))
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("step_00000050.aside.")]
    assert len(aside) == 1 and run_of(aside[0]) == "a" and verify(aside[0]) is None
    assert run_of(tmp_path / "step_00000050") == "b"
    assert Checkpointer(tmp_path, keep=2, rank=0, world_size=1, run_id="c").resolve("never") is None


def test_a_pickle_that_runs_code_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    path = tmp_path / "evil.pt"
    with open(path, "wb") as f:
        pickle.dump({"w": Evil()}, f)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)
    assert not (tmp_path / "pwned").exists()

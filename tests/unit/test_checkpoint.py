"""Checkpoint folder scheme: atomic rename, `latest`, keep-last-K, manifest checks.
Runs in one real gloo process group of size 1."""

from __future__ import annotations

import os
import pickle
import socket
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from launcher.manifest import find_latest, read_latest, run_of, verify
from launcher.rank.checkpoint import Checkpointer


class TinyEngine:
    def __init__(self, value: float):
        self.w = torch.full((4,), value)

    def save(self, path: Path, staging=None):
        state = {"w": self.w} if staging is None else staging.staged({"w": self.w})

        def write() -> None:
            path.mkdir(parents=True, exist_ok=True)
            torch.save(state, path / "model.pt")

        if staging is not None:
            return write
        write()

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


def test_keep_k_keeps_the_newest_verified_and_sets_a_failing_one_aside(tmp_path):
    """Issue 47, 2: steps 2 and 4 kept (keep=2), a byte of step 4 flipped; the relaunch
    (keep=1) resumes from 2 and saves 3. Step 4 is set aside (renamed, not deleted, never
    counted), keep-K deletes step 2 and keeps the verified step 3, which `latest` names.
    Before: keep-K by step number deleted 2 and 3 and left `latest` naming step 3."""
    first = Checkpointer(tmp_path, keep=2, rank=0, world_size=1, run_id="r")
    for step in (2, 4):
        first.save(step, step, TinyEngine(step))
    model = tmp_path / "step_00000004" / "engine" / "model.pt"
    data = bytearray(model.read_bytes())
    data[-20] ^= 0xFF
    model.write_bytes(bytes(data))
    again = Checkpointer(tmp_path, keep=1, rank=0, world_size=1, run_id="r")
    assert again.resolve("auto").name == "step_00000002"
    assert read_latest(tmp_path) == ("step_00000002", "r")  # never a folder that is gone
    again.save(3, 3, TinyEngine(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000003", "step_00000004.failed"]
    assert read_latest(tmp_path) == ("step_00000003", "r") and verify(tmp_path / "step_00000003") is None
    assert "sha256" in verify(tmp_path / "step_00000004.failed")  # kept as it was, for a look
    assert Checkpointer(tmp_path, keep=1, rank=0, world_size=1, run_id="r").resolve("auto").name == "step_00000003"


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


class SlowEngine(TinyEngine):
    """Its async write waits for `go` (a slow disk), or fails as a full disk does."""

    def __init__(self, value: float, go: threading.Event, fail: bool = False):
        super().__init__(value)
        self.go, self.fail = go, fail

    def save(self, path: Path, staging=None):
        write = super().save(path, staging)

        def slow() -> None:
            self.go.wait(30)
            if self.fail:
                raise OSError(28, "No space left on device")
            write()

        return slow


def test_an_async_save_publishes_in_the_background_what_was_staged(tmp_path):
    ck = Checkpointer(tmp_path, keep=2, rank=0, world_size=1, async_save=True)
    ck.save(10, 80, TinyEngine(10))
    assert ck.saver.wait() == 10 and read_latest(tmp_path)[0] == "step_00000010"
    go = threading.Event()
    engine = SlowEngine(20, go)
    final = ck.save(20, 160, engine)
    engine.w.fill_(99.0)  # the next step changes the weights while the save is being written
    assert ck.saver.done() is None and not final.exists() and read_latest(tmp_path)[0] == "step_00000010"
    go.set()
    assert ck.saver.wait() == 20 and ck.saver.pending is None and ck.saver.wait() is None
    assert verify(final) is None and read_latest(tmp_path)[0] == "step_00000020"
    assert torch.load(final / "engine" / "model.pt", weights_only=True)["w"][0] == 20  # the staged copy
    assert set(ck.timing) == {"stage_s", "write_s", "digests_s", "publish_s"}
    engine.go = threading.Event()  # the same engine again: the staging buffers are reused
    engine.go.set()
    ck.save(30, 240, engine)
    assert ck.saver.wait() == 30
    assert torch.load(tmp_path / "step_00000030" / "engine" / "model.pt", weights_only=True)["w"][0] == 99
    assert torch.load(final / "engine" / "model.pt", weights_only=True)["w"][0] == 20


def test_a_failed_async_save_is_raised_by_the_next_wait_and_publishes_nothing(tmp_path):
    ck = Checkpointer(tmp_path, keep=2, rank=0, world_size=1, async_save=True)
    ck.save(10, 80, TinyEngine(10))
    go = threading.Event()
    ck.save(20, 160, SlowEngine(20, go, fail=True))
    go.set()
    with pytest.raises(OSError, match="No space left"):
        ck.saver.wait()
    assert ck.saver.pending is None and ck.saver.wait() is None
    assert find_latest(tmp_path).name == "step_00000010" and read_latest(tmp_path)[0] == "step_00000010"


def test_the_next_async_save_waits_for_the_one_in_flight(tmp_path):
    """At most one save is in flight: a save called while the previous one is still being
    written stages nothing until that one is published."""
    ck = Checkpointer(tmp_path, keep=3, rank=0, world_size=1, async_save=True)
    go = threading.Event()
    ck.save(10, 80, SlowEngine(10, go))
    second = threading.Thread(target=ck.save, args=(20, 160, TinyEngine(20)))
    second.start()
    second.join(0.5)
    assert second.is_alive() and not (tmp_path / "step_00000020.tmp").exists()
    assert read_latest(tmp_path) is None
    go.set()
    second.join(10)
    assert read_latest(tmp_path)[0] in ("step_00000010", "step_00000020")
    assert ck.saver.wait() == 20 and read_latest(tmp_path)[0] == "step_00000020"
    assert verify(tmp_path / "step_00000010") is None and verify(tmp_path / "step_00000020") is None

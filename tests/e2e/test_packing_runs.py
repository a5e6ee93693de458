"""Packed micro-batches (inputs, targets, positions) travel through every engine: ddp, fsdp,
zero3 (zero1 and zero2 share its step: DeepSpeed's engine hands the positions on), tp with
sequence parallel, and pp (the schedule hands each stage its micro-batch's positions).
One torchrun of 2 ranks (tests/helpers/packing_probe.py) builds each engine through the
rank's build_engine, trains 2 steps and evaluates once on hand-built packed rows (a
prompt, padding, a row with nothing counted); the losses equal one process training the
whole model on the same rows, and differ from the same rows without their positions.
The data side's windows (data=chat, hf_text) reach the same step through the loop."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from runs import REPO

pytestmark = pytest.mark.slow

LAYOUTS = ["ddp", "fsdp", "zero3", "tp_sp", "pp"]


@pytest.fixture(scope="module")
def losses(tmp_path_factory) -> dict:
    """One launch for all five layouts (measured: 76 CPU-s, most of it five engines' start-up)."""
    out = tmp_path_factory.mktemp("packing") / "losses.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "tests/helpers/packing_probe.py",
            str(out),
            *LAYOUTS,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_engine_trains_and_evaluates_packed_windows_as_one_process(losses, layout):
    want, got = losses["reference"], losses[layout]
    assert got["train"] == pytest.approx(want["train"], abs=1e-5), layout
    assert got["eval"] == pytest.approx(want["eval"], abs=1e-5), layout


def test_the_positions_change_the_loss(losses):
    """Otherwise the comparison above would hold for an engine that dropped them."""
    packed, unpacked = losses["reference"], losses["unpacked"]
    assert all(
        abs(a - b) > 1e-3 for a, b in zip(packed["train"] + [packed["eval"]], unpacked["train"] + [unpacked["eval"]])
    )

"""The loss guard's verdicts (launcher/rank/guard.py) in a real one-rank gloo group: what is
bad, when a spike can be called, what fp16 leaves to its scaler, and the way out when
there is no checkpoint. The runs that skip, roll back and read the checkpoints back:
tests/e2e/test_guard_runs.py."""

from __future__ import annotations

import math

import torch

from launcher import config as C
from launcher.rank.checkpoint import Checkpointer
from launcher.rank.guard import WARM, LossGuard


def guard(max_bad_steps=2, spike_factor=3.0, precision="fp32") -> tuple[LossGuard, list[str]]:
    cfg = C.Config()
    cfg.train.max_bad_steps, cfg.train.spike_factor = max_bad_steps, spike_factor
    cfg.precision.name = C.Precision(precision)
    said: list[str] = []
    return LossGuard(cfg, torch.device("cpu"), slices=1, say=said.append), said


def admit(g: LossGuard, loss: float, norm: float = 1.0) -> bool:
    g.step += 1
    return g.admit(torch.tensor(loss), True, torch.tensor(norm))


def test_off_admits_everything_and_counts_nothing(one_rank_group):
    g, said = guard(max_bad_steps=0, spike_factor=0.0)
    assert admit(g, math.nan, math.nan) and admit(g, 1e9)
    assert (g.skipped, g.in_row, g.metrics(), said) == (0, 0, {}, [])


def test_a_non_finite_gradient_or_loss_is_skipped_and_counted_in_a_row(one_rank_group):
    g, said = guard()
    assert admit(g, 2.0)
    assert not admit(g, 2.0, math.nan) and not admit(g, math.inf, 1.0)
    assert (g.skipped, g.in_row, g.due()) == (2, 2, True)
    assert "step 2 skipped (gradient norm nan)" in said[0] and "step 3 skipped (loss inf)" in said[1]
    assert admit(g, 2.0) and (g.in_row, g.due()) == (0, False)  # a good step ends the row
    assert g.metrics() == {"guard/skipped_steps": 2, "guard/rollbacks": 0}


def test_a_spike_is_called_only_against_a_warm_window_of_applied_steps(one_rank_group):
    g, said = guard(spike_factor=3.0)
    assert admit(g, 100.0)  # nothing to compare with yet: applied, and it joins the window
    for _ in range(WARM - 1):
        assert admit(g, 1.0)
    mean = (100.0 + WARM - 1) / WARM
    assert admit(g, 2.9 * mean)
    assert not admit(g, 3.1 * (sum(g.recent) / len(g.recent)))
    assert "above train.spike_factor=3" in said[-1]
    assert len(g.recent) == WARM + 1  # the skipped step's loss stays out of the mean


def test_fp16_leaves_non_finite_steps_to_its_loss_scaler_but_still_calls_spikes(one_rank_group):
    g, _ = guard(precision="fp16")
    assert admit(g, math.nan, math.inf)  # the scaler skips it and lowers its scale
    for _ in range(WARM):
        assert admit(g, 1.0)
    assert not admit(g, 10.0)


def test_no_checkpoint_to_go_back_to_stops_with_one_reason(one_rank_group, tmp_path):
    g, _ = guard(max_bad_steps=1)
    assert not admit(g, 1.0, math.nan) and g.due()
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=3, rank=0, world_size=1, run_id="run-a")
    import contextlib

    why = g.roll_back(engine=None, checkpointer=ckpt, pause=contextlib.nullcontext)
    assert why is not None and "no checkpoint to go back to" in why and "step 1" in why
    assert g.rollbacks == 0

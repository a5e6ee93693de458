"""train.straggler_factor (launcher/rank/straggler.py): which rank is compared with which,
and which modules are timed. The measure on real ranks: tests/e2e/test_straggler_runs.py."""

from __future__ import annotations

import pytest

from launcher.rank.straggler import slowest, timed_modules


def test_the_slowest_rank_is_the_one_furthest_above_its_stages_median():
    # (compute_s, data_s, stage) by rank: 4 ranks of one stage, rank 2 slow in its data loader
    rows = [[0.10, 0.01, 0], [0.11, 0.01, 0], [0.10, 0.30, 0], [0.10, 0.01, 0]]
    r, work, median = slowest(rows)
    assert r == 2 and work == pytest.approx(0.40) and median == pytest.approx(0.11)  # the others' median


def test_with_two_ranks_a_rank_twice_as_slow_reads_twice():
    """The median of the others: with itself in it, 2x slow would read 2/1.5 = 1.33x."""
    r, work, median = slowest([[2.0, 0, 0], [1.0, 0, 0]])
    assert (r, work / median) == (0, 2.0)


def test_pipeline_stages_are_compared_within_themselves():
    """A pipeline's first and last stages hold the embedding and the head: more work than
    the middle's, by design. Rank 1 (stage 0) is the slowest of all, but it is stage 0's
    normal; rank 3 is 1.5x its own stage's peers."""
    rows = [[0.30, 0, 0], [0.31, 0, 0], [0.10, 0, 1], [0.15, 0, 1], [0.10, 0, 1]]
    r, work, median = slowest(rows)
    assert (r, work, median) == (3, 0.15, 0.10)


def test_nothing_is_compared_where_no_stage_has_two_ranks():
    assert slowest([[0.1, 0, 0], [0.5, 0, 1]]) is None


def test_the_timed_modules_are_the_leaves_that_hold_parameters():
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.proj, self.act = nn.LayerNorm(4), nn.Linear(4, 4), nn.GELU()

    class Engine:  # as DDP wraps the model: `module` inside `model`; no pipeline stages
        model, stages = nn.Module(), ()

    Engine.model.module = model = nn.Sequential(nn.Embedding(8, 4), Block(), Block())
    timed = timed_modules(Engine, compiled=False)
    assert [type(m).__name__ for m in timed] == ["Embedding", "LayerNorm", "Linear", "LayerNorm", "Linear"]
    assert timed_modules(Engine, compiled=True) == [model]  # compiled: the model's forward, whole

"""Data: the Markov source's entropy floor, determinism, sharding, memmap files."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from runs import token_file

from launcher.config import DataConfig, TokenDtype
from launcher.data.read import MarkovSource, StepSampler, TokenFile


def test_entropy_rate_matches_the_empirical_log_loss():
    """Shannon-McMillan-Breiman: the mean -log p(x_t | context) of a long sample
    converges to the entropy rate; the source knows its own probabilities."""
    src = MarkovSource(DataConfig(), seq_len=512)
    seqs = src.generate(list(range(64)))
    nll = []
    for seq in seqs:
        for t in range(src.order, len(seq)):
            state = src._state(seq[None, t - src.order : t])[0]
            nll.append(-math.log(src.prob(state, seq[t])))
    assert np.mean(nll) == pytest.approx(src.entropy_rate, rel=0.02)


def test_floor_is_well_below_half_the_uniform_loss():
    src = MarkovSource(DataConfig(), seq_len=128)
    assert src.loss_floor() < 0.5 * math.log(256)


def test_samples_are_deterministic_and_independent_of_batching():
    src = MarkovSource(DataConfig(), seq_len=64)
    together = src.__getitems__([5, 6, 7])
    alone = torch.stack([src[7], src[5], src[6]])
    assert torch.equal(together[[2, 0, 1]], alone)
    assert not torch.equal(src[5], src[6])
    assert together.max() < 256 and together.min() >= 0


def test_sampler_partitions_each_global_batch():
    # 2 ranks, micro 2, global 8 -> accum 2: each step's 8 indices split without overlap.
    ranks = [iter(StepSampler(start=16, global_batch=8, dp_rank=r, dp_size=2, micro_batch=2)) for r in range(2)]
    seen = []
    for _ in range(2):  # one step = accum micro-batches per rank
        for it in ranks:
            seen += next(it) + next(it)
    assert sorted(seen[:8]) == list(range(16, 24))


def test_resume_at_another_world_size_sees_the_same_data():
    one = iter(StepSampler(start=32, global_batch=8, dp_rank=0, dp_size=1, micro_batch=8))
    two = [iter(StepSampler(start=32, global_batch=8, dp_rank=r, dp_size=2, micro_batch=4)) for r in range(2)]
    assert sorted(next(one)) == sorted(next(two[0]) + next(two[1]))


def test_prepare_data_and_token_file(tmp_path):
    out = token_file(tmp_path, "hello launcher, " * 500)
    assert out.stat().st_size == 2 * len("hello launcher, " * 500)
    ds = TokenFile(DataConfig(name="memmap", path=str(out), dtype=TokenDtype.uint16), seq_len=32, seed=0)
    a = ds.__getitems__(list(range(ds.windows)))  # one epoch: every window once
    assert a.shape == (ds.windows, 33)
    assert bytes(a[0, :-1].tolist()).decode() in "hello launcher, " * 500
    starts = sorted(ds._window(i) for i in range(ds.windows))
    assert starts == list(range(ds.windows))


def test_a_backed_off_micro_batch_sees_the_same_samples_in_the_same_order():
    """train.oom_backoff: 8 x 1 -> 4 x 2 per rank; each rank's step is the same sequences."""
    for rank in range(2):
        big = iter(StepSampler(start=48, global_batch=16, dp_rank=rank, dp_size=2, micro_batch=8))
        small = iter(StepSampler(start=48, global_batch=16, dp_rank=rank, dp_size=2, micro_batch=4))
        for _ in range(3):
            assert next(big) == next(small) + next(small)

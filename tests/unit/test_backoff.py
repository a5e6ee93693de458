"""train.oom_backoff's arithmetic and the rank's in-place retry (launcher/rank/backoff.py),
in-process; the runs that back off are in tests/e2e/test_backoff_runs.py."""

from __future__ import annotations

import pytest
import torch

from launcher.parallel.degrees import backed_off
from launcher.rank import backoff


@pytest.mark.parametrize(
    "micro, accum, after",
    [(8, 1, (4, 2)), (6, 1, (3, 2)), (3, 2, (1, 6)), (7, 1, (1, 7)), (2, 4, (1, 8)), (1, 3, None)],
)
def test_the_next_micro_batch_divides_this_one_and_keeps_the_batch(micro, accum, after):
    assert backed_off(micro, accum) == after
    if after is not None:
        assert after[0] * after[1] == micro * accum


def test_the_step_in_hand_is_cut_into_the_smaller_micro_batches_in_order():
    seqs = torch.arange(8 * 5).view(8, 5)
    step = [(seqs[:8, :-1], seqs[:8, 1:])]
    cut = backoff.split(step, 4)
    assert len(cut) == 2 and all(x.shape == (4, 4) for x, _ in cut)
    assert torch.equal(torch.cat([x for x, _ in cut]), seqs[:, :-1]) and torch.equal(
        torch.cat([y for _, y in cut]), seqs[:, 1:]
    )


@pytest.mark.parametrize(
    "err, oom",
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
        (RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory"), True),
        (RuntimeError("Expected all tensors to be on the same device"), False),
    ],
)
def test_what_counts_as_out_of_memory(err, oom):
    assert backoff.is_out_of_memory(err) == oom

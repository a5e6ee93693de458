"""The experts' SwiGLU (launcher/models/experts.py::_SwiGLU): its written-out backward equals
autograd's over the per-expert slices, on the loop and on the grouped path, and what it saves
for backward holds the stacked weights themselves, never a view of them (ZeRO-3 could not
free a gathered expert tensor a view keeps)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from launcher.models.experts import _GroupedOps, _SwiGLU


def reference(x, w1, w2, w3, counts):
    """The loop the Function replaces: autograd over the slices w[e]."""
    outs = [
        F.linear(F.silu(F.linear(c, w1[e])) * F.linear(c, w3[e]), w2[e])
        for e, c in enumerate(torch.split(x, counts.tolist()))
    ]
    return torch.cat(outs)


def inputs(dtype, dim=16, hidden=32, counts=(3, 0, 5, 2)):
    g = torch.Generator().manual_seed(0)
    E, n = len(counts), sum(counts)
    ws = [
        torch.randn(E, hidden, dim, generator=g),
        torch.randn(E, dim, hidden, generator=g),
        torch.randn(E, hidden, dim, generator=g),
    ]
    x = torch.randn(n, dim, generator=g)
    return (
        [t.to(dtype).requires_grad_() for t in (x, *ws)],
        torch.tensor(counts),
        torch.randn(n, dim, generator=g).to(dtype),
    )


def grads(fn, leaves, dy):
    y = fn(*leaves)
    return [y.detach(), *torch.autograd.grad(y, leaves, dy)]


@pytest.mark.parametrize("grouped", [False, True])
def test_the_written_backward_equals_autograds(grouped):
    """Output and every gradient (the rows', each weight's, a zero one for the expert with no
    rows): fp32 on the loop to 1e-5; bf16 on the grouped path (torch._grouped_mm's CPU
    fallback) to 1% in norm of the same loop in fp32 on the same bf16 numbers."""
    dtype = torch.bfloat16 if grouped else torch.float32
    leaves, counts, dy = inputs(dtype)
    mine = grads(lambda x, w1, w2, w3: _SwiGLU.apply(x, w1, w2, w3, counts, grouped, dtype), leaves, dy)
    ref = grads(lambda x, w1, w2, w3: reference(x, w1, w2, w3, counts), leaves, dy)
    exact = grads(lambda *a: reference(*a, counts), [t.detach().float().requires_grad_() for t in leaves], dy.float())
    for a, b, c in zip(mine, ref, exact):
        assert a.dtype == b.dtype and a.shape == b.shape
        if grouped:
            assert (a.float() - c).norm() <= 1e-2 * c.norm()
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not mine[2][1].any() and not mine[3][1].any() and not mine[4][1].any()  # expert 1: no rows


def saved_storages(fn, leaves):
    """The storages autograd keeps for backward, each as (pointer, is one of the leaves)."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn(*leaves)
    return [(t.untyped_storage().data_ptr(), any(t is leaf for leaf in leaves)) for t in saved]


def test_only_the_whole_weights_hold_their_storage():
    """The slices' autograd saves views w[e] of the stacked weights (the defect); the Function
    saves the weight tensors themselves, which ZeRO-3's data swap empties after forward."""
    leaves, counts, _ = inputs(torch.float32)
    weights = {w.untyped_storage().data_ptr() for w in leaves[1:]}
    views = [leaf for ptr, leaf in saved_storages(lambda *a: reference(*a, counts), leaves) if ptr in weights]
    assert views and not any(views)
    mine = [
        leaf
        for ptr, leaf in saved_storages(lambda *a: _SwiGLU.apply(*a, counts, False, torch.float32), leaves)
        if ptr in weights
    ]
    assert len(mine) == 3 and all(mine)


def test_grouped_ops_match_the_loop():
    """The three grouped products against expert-by-expert matmuls (bf16, CPU fallback)."""
    (x, w1, _, _), counts, _ = inputs(torch.bfloat16)
    x, w1 = x.detach(), w1.detach()
    ops, parts = _GroupedOps(counts), torch.split(x, counts.tolist())
    h = ops.forward(x, w1)
    want = torch.cat([p.float() @ w1[e].float().t() for e, p in enumerate(parts)])
    torch.testing.assert_close(h.float(), want, rtol=2e-2, atol=2e-1)
    g = ops.weight_grad(h, x)
    assert g.shape == w1.shape and not g[1].any()

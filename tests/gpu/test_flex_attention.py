"""Packed windows on CUDA (data.document_masking): the project's decoder attends through
FlexAttention (torch.compile'd) with a block mask there, the path the CPU cannot run
(torch 2.13: no FlexAttention backward on CPU; tests/unit/test_packing.py checks the mask
itself, forward only). Here, in one process: the packed window's losses and gradients
equal the dense additive-mask SDPA's (the CPU's path), and its samples run alone.
Skipped without a CUDA GPU."""

from __future__ import annotations

import functools

import pytest
import torch

from launcher.launch import cli
from launcher.models import attention, gpt

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

LENGTHS = [300, 41, 1, 500, 180]  # one window of 1024 with its padding


def window(vocab: int, device: torch.device):
    g = torch.Generator().manual_seed(0)
    parts = [torch.randint(0, vocab, (n + 1,), generator=g) for n in LENGTHS]
    pad = 1024 - sum(LENGTHS)
    x = torch.cat([p[:-1] for p in parts] + [torch.zeros(pad, dtype=torch.long)])
    y = torch.cat([p[1:] for p in parts] + [torch.full((pad,), -100)])
    pos = torch.cat([torch.arange(n) for n in LENGTHS] + [torch.arange(pad)])
    return parts, *(t[None].to(device) for t in (x, y, pos))


def test_flex_attention_trains_as_the_dense_mask_and_as_the_samples_alone(monkeypatch):
    cfg, _, _ = cli.compose_config(["model=gpt_small", "model.max_seq_len=1024"])
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = gpt.GPT(cfg.model).to(device)
    parts, x, y, pos = window(cfg.model.vocab_size, device)
    params = list(model.parameters())

    def token_sum_and_grads(*batch):
        loss = model(*batch) * (batch[1] != -100).sum()
        return loss.detach(), torch.autograd.grad(loss, params)

    flex = token_sum_and_grads(x, y, pos)
    with monkeypatch.context() as m:
        m.setattr(gpt, "DocumentMask", functools.partial(attention.DocumentMask, flex=False))
        dense = token_sum_and_grads(x, y, pos)
    alone = [token_sum_and_grads(p[None, :-1].to(device), p[None, 1:].to(device)) for p in parts]
    alone_loss = sum(a[0] for a in alone)
    alone_grads = [sum(gs) for gs in zip(*(a[1] for a in alone))]
    torch.testing.assert_close(flex[0], dense[0], rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(flex[0], alone_loss, rtol=1e-4, atol=1e-3)
    for f, d, a in zip(flex[1], dense[1], alone_grads):
        torch.testing.assert_close(f, d, rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(f, a, rtol=1e-3, atol=1e-4)

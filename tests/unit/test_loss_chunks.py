"""train.loss_chunks: the loss over slices of the sequence (launcher/models/gpt.py::SlicedLoss)
equals the whole loss, and the planner's bytes for it (activations and temporaries) match
what torch's MemTracker sees at the step's peak. Real runs under ddp, fsdp and zero3:
tests/e2e/test_parallel_train.py::test_the_loss_in_slices_under_sharding."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from launcher.config import ACMode, Precision, loss_chunks
from launcher.launch import cli
from launcher.models.gpt import GPT
from launcher.planner import memory as M
from launcher.planner.footprint import Layout, numerics, temporaries


def loss_and_grads(model: GPT, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype | None):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
        loss = model(x, y)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_the_loss_in_slices_equals_the_whole_loss(tie):
    """fp32: loss and every gradient equal to fp32 rounding, with slices of unequal length
    and an ignored target. bf16: both computations against the fp32 one, the sliced no
    further from it than the whole (it accumulates dL/dweight in fp32)."""
    cfg, _, _ = cli.compose_config(["model=gpt_tiny", "model.vocab_size=300", f"model.tie_embeddings={tie}"])
    torch.manual_seed(0)
    whole = GPT(cfg.model)
    sliced = copy.deepcopy(whole)
    sliced.loss_chunks = 4
    x, y = torch.randint(0, 300, (2, 33)), torch.randint(0, 300, (2, 33))
    y[0, 3] = -100  # cross_entropy's ignore_index: out of the mean
    ref_loss, ref = loss_and_grads(whole, x, y, None)
    loss, grads = loss_and_grads(sliced, x, y, None)
    assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=0)
    for k in ref:
        assert (grads[k] - ref[k]).norm() <= 1e-5 * ref[k].norm(), k
    err = {}
    for name, model in (("whole", whole), ("sliced", sliced)):
        loss, grads = loss_and_grads(model, x, y, torch.bfloat16)
        assert abs(loss - ref_loss) < 1e-2
        err[name] = max(((grads[k] - ref[k]).norm() / ref[k].norm()).item() for k in ref)
    assert err["sliced"] <= 1.5 * err["whole"] and err["sliced"] < 0.02, err


def peak(model: GPT, x, y, dtype) -> int:
    """Activations and temporaries at the step's peak (parameters and gradients apart)."""
    model.zero_grad(set_to_none=True)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = model(x, y)
        loss.backward()
    at_peak = next(v for k, v in tracker.get_tracker_snapshot("peak").items() if str(k) == "cpu")
    parts = {str(k).split(".")[-1]: v for k, v in at_peak.items()}
    return parts["ACT"] + parts["TEMP"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_planner_against_a_memory_tracker(precision):
    """A vocabulary large against the model (the loss makes the step's peak, as at 128k):
    the planner's activations + temporaries within 2% of MemTracker's at the peak, whole and
    in 4 slices; the slices cut the peak by more than half."""
    V, s, b = 32768, 256, 2
    cfg, _, _ = cli.compose_config(["model=gpt_tiny", f"model.vocab_size={V}", f"model.max_seq_len={s}"])
    torch.manual_seed(0)
    model = GPT(cfg.model)
    x = torch.randint(0, V, (b, s + 1))
    dtype = torch.bfloat16 if precision == "bf16" else None
    n = numerics(Precision(precision), Layout("ddp", 1))
    measured, planned = {}, {}
    for chunks in (1, 4):
        model.loss_chunks = chunks
        measured[chunks] = peak(model, x[:, :-1], x[:, 1:], dtype)
        planned[chunks] = M.activation_bytes(cfg.model, b, s, n, ACMode.none, loss_chunks=chunks) + temporaries(
            cfg.model, Precision(precision), Layout("ddp", 1), ACMode.none, 2, b, s, chunks
        )
    print({c: (f"{measured[c] / 2**20:.2f} MiB measured", f"{planned[c] / 2**20:.2f} MiB planned") for c in measured})
    for chunks in (1, 4):
        assert abs(planned[chunks] / measured[chunks] - 1) < 0.02, chunks
    assert measured[4] < 0.5 * measured[1]


def test_auto_slices_keep_a_slice_within_256_mib():
    cfg, _, _ = cli.compose_config(["model=gpt_tiny"])
    assert loss_chunks(cfg, 256, 8, True) == 1  # the test models: off
    cfg, _, _ = cli.compose_config(["model=llama3_8b", "train.seq_len=8192", "train.micro_batch=1"])
    assert loss_chunks(cfg, 128256, 1, True) == 16  # 4.2 GB of fp32 logits in slices of 263 MB
    assert loss_chunks(cfg, 128256, 1, False) == 1  # a pipeline, tensor parallel, model=hf
    cfg, _, _ = cli.compose_config(["model=llama3_8b", "train.loss_chunks=3"])
    assert loss_chunks(cfg, 128256, 1, True) == 3

"""Packed windows (data.document_masking): several samples in one window, positions
restarting at each, attention block-causal within a sample. The loss of a packed window
is its samples' losses run alone (token sums, and gradients), for the project's decoder
and a Hugging Face Llama; without positions nothing changes; a window with no counted
target gives 0, not NaN."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from launcher.config import ACMode
from launcher.launch import cli
from launcher.models.attention import DocumentMask, attend
from launcher.models.gpt import GPT, lm_loss, set_activation_checkpointing
from launcher.parallel.cuts import Stage

LENGTHS = [6, 11, 1, 9]  # the samples of one window (tokens incl. the one predicted last)
PAD = 4  # padding at the window's end: its own segment, nothing counted


def samples(vocab: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, targets) of each sample alone; the second's first three targets are a prompt (-100)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(LENGTHS):
        tokens = torch.randint(0, vocab, (n + 1,), generator=g)
        x, y = tokens[:-1].clone(), tokens[1:].clone()
        if i == 1:
            y[:3] = -100
        out.append((x, y))
    return out


def packed(parts: list[tuple[torch.Tensor, torch.Tensor]], rows: int = 2):
    """The samples side by side in one window, then padding; `rows` copies, the second in
    reverse order (a batch of 2 windows that differ)."""
    batch = []
    for r in range(rows):
        order = parts if r % 2 == 0 else parts[::-1]
        x = torch.cat([p[0] for p in order] + [torch.zeros(PAD, dtype=torch.long)])
        y = torch.cat([p[1] for p in order] + [torch.full((PAD,), -100)])
        pos = torch.cat([torch.arange(len(p[0])) for p in order] + [torch.arange(PAD)])
        batch.append((x, y, pos))
    return tuple(torch.stack(t) for t in zip(*batch))


def token_sum(model, x, y, pos=None) -> torch.Tensor:
    loss = model(x, y) if pos is None else model(x, y, pos)
    return loss * (y != -100).sum()


def grads(model, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    return dict(zip(params, torch.autograd.grad(loss, list(params.values()))))


def assert_packing_is_exact(model, vocab: int) -> None:
    """The packed batch's token-sum loss and gradients = the sum over its samples run alone."""
    parts = samples(vocab, seed=3)
    x, y, pos = packed(parts)
    together = token_sum(model, x, y, pos)
    alone = sum(token_sum(model, a[None], b[None]) for a, b in parts) * 2  # each row holds every sample
    assert together.item() == pytest.approx(alone.item(), rel=1e-5, abs=1e-5)
    g_together, g_alone = grads(model, together), grads(model, alone)
    for name, g in g_together.items():
        torch.testing.assert_close(g, g_alone[name], rtol=1e-5, atol=1e-5, msg=name)
    # and the positions matter: the same window unpacked is another loss
    assert abs(token_sum(model, x, y).item() - together.item()) > 1e-3
    assert_rotary_restarts(model, x, pos)


def assert_rotary_restarts(model, x, pos) -> None:
    """Rotary angles come from the positions. (The mask alone makes the losses above equal:
    rotary attention depends on the distance between positions only; the angles of large
    absolute positions are what it saves, in fp32 and more so in bf16.)"""
    seen = []
    if isinstance(model, GPT):  # the rows each block rotates by
        hook = model.layers[0].register_forward_pre_hook(lambda m, args: seen.append(args[1]))
        want = model.rope[pos]
    else:  # the position ids transformers' rotary embedding reads
        hook = model.hf.model.rotary_emb.register_forward_pre_hook(
            lambda m, args, kwargs: seen.append(kwargs["position_ids"]), with_kwargs=True
        )
        want = pos
    with torch.no_grad():
        model(x, positions=pos)
    hook.remove()
    assert torch.equal(seen[0], want)


def gpt(**changes) -> GPT:
    cfg, _, _ = cli.compose_config(["model=gpt_tiny", "model.n_kv_heads=2", "model.tie_embeddings=false"])
    for k, v in changes.items():
        setattr(cfg.model, k, v)
    torch.manual_seed(0)
    return GPT(cfg.model)


@pytest.mark.parametrize("ac, chunks", [(ACMode.none, 1), (ACMode.op, 1), (ACMode.full, 3)])
def test_the_decoder_packs_exactly(ac, chunks):
    """Also through recomputation (the mask is made inside the first checkpointed block and
    reused when it runs again) and the loss in slices (SlicedLoss)."""
    model = gpt()
    set_activation_checkpointing(model, ac, 2)
    model.loss_chunks = chunks
    assert_packing_is_exact(model, 256)


def tiny_llama(attn: str, **changes):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from launcher.models.hf import HFCausalLM
    from tests.helpers.hf_models import TINY_LLAMA

    torch.manual_seed(0)
    fields = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"} | changes
    model = AutoModelForCausalLM.from_config(LlamaConfig(**fields), attn_implementation=attn, dtype=torch.float32)
    model.config.use_cache = False
    return HFCausalLM(model)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_hugging_face_llama_packs_exactly(attn):
    assert_packing_is_exact(tiny_llama(attn), 300)


def test_our_mask_is_what_transformers_makes_of_packed_position_ids():
    """transformers >= 5 builds the block-causal mask itself from packed position_ids
    (masking_utils.find_packed_sequence_indices); hf.packed_mask passes the same mask as
    floats, once (a boolean one SDPA would copy to floats at every layer)."""
    model = tiny_llama("sdpa")
    x, _, pos = packed(samples(300, seed=4))
    with torch.no_grad():
        ours = model(x, positions=pos)
        theirs = model.hf(input_ids=x, position_ids=pos, use_cache=False).logits
        unpacked = model(x)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert (ours - unpacked).abs().max() > 1e-3


def test_without_positions_the_loss_and_gradients_are_todays_bit_for_bit():
    """positions=None: no mask (SDPA's is_causal), the table's rows 0..T-1, and the loss the
    mean cross-entropy it always was (F.cross_entropy's own mean), to the last bit."""
    model = gpt()
    x, y, _ = packed(samples(256, seed=5))
    y[0, :5] = -100
    loss = model(x, y)
    today = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
    assert torch.equal(loss, today)
    g, g_today = grads(model, loss), grads(model, today)
    assert all(torch.equal(g[k], g_today[k]) for k in g)


def test_a_window_with_nothing_to_count_gives_zero_not_nan():
    """A chat window of prompt alone: loss 0 and zero gradients, in training (whole and in
    slices), in evaluation (the head's no-grad branch) and for model=hf."""
    x, y, pos = packed(samples(256, seed=6))
    y = torch.full_like(y, -100)
    for model in (gpt(), gpt(), tiny_llama("sdpa")):
        loss = model(x, y, pos)
        assert loss.item() == 0.0
        assert all(torch.count_nonzero(g) == 0 for g in grads(model, loss).values())
        with torch.no_grad():
            assert model(x, y, pos).item() == 0.0
        if isinstance(model, GPT):
            model.loss_chunks = 2  # the second one: the loss in slices
    assert lm_loss(torch.randn(2, 3, 5), torch.full((2, 3), -100)).item() == 0.0


def test_rotary_rows_of_a_packed_window_are_each_sample_alone():
    from launcher.models.attention import apply_rotary, rotary_at, rotary_table

    table = rotary_table(16, 64, 10000.0)
    parts = [torch.randn(1, n, 2, 16) for n in LENGTHS]
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    together = apply_rotary(torch.cat(parts, dim=1), rotary_at(table, pos))
    assert torch.equal(together, torch.cat([apply_rotary(p, table) for p in parts], dim=1))


def test_flex_attention_masks_as_the_dense_mask_does():
    """FlexAttention's block mask (CUDA's path) gives what the additive SDPA mask gives; on
    the CPU forward only: torch 2.13 has no FlexAttention backward there."""
    _, _, pos = packed(samples(256, seed=7))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, pos.shape[1], 16, generator=g) for _ in range(3))
    with torch.no_grad():
        dense = attend(q, k, v, DocumentMask(pos, flex=False))
        flex = attend(q, k, v, DocumentMask(pos, flex=True))
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="positions of shape"):  # a sequence split the positions did not follow
        attend(q[:, :, :8], k[:, :, :8], v[:, :, :8], DocumentMask(pos, flex=False))


@pytest.mark.parametrize("kind", ["gpt", "hf"])
def test_a_pipeline_stage_takes_the_positions(kind):
    """A pipeline stage gets the positions as a keyword beside its hidden states
    (engines/pp/engine.py); cut in two, the stages give the whole model's logits."""
    model = gpt() if kind == "gpt" else tiny_llama("sdpa")
    x, _, pos = packed(samples(256, seed=8))
    with torch.no_grad():
        whole = model(x, positions=pos)
        first, second = Stage(model, [0, 1]), Stage(model, [2, 3])
        torch.testing.assert_close(second(first(x, positions=pos), positions=pos), whole, rtol=1e-5, atol=1e-5)


def test_the_hf_mask_is_held_once_not_per_layer():
    """What autograd saves for a packed batch beyond an unpacked one (model=hf, 4 layers,
    no GQA so both repeat nothing): our additive mask once (plus the rotary rows of each
    window); transformers' own boolean mask from position_ids is copied to floats by SDPA
    at every layer and each copy saved: the reason hf.packed_mask exists."""
    from launcher.planner.memory import ActivationCounter

    model = tiny_llama("sdpa", num_key_value_heads=4)
    x, y, pos = packed(samples(300, seed=9))
    mask = 4 * x.numel() * x.shape[1]  # fp32, b x s x s

    def saved(**kwargs) -> int:
        with ActivationCounter(model) as counter:
            lm_loss(model.hf(input_ids=x, use_cache=False, **kwargs).logits, y).backward()
        return counter.bytes

    with ActivationCounter(model) as counter:
        model(x, y, pos).backward()
    ours, unpacked = counter.bytes, saved()
    assert mask <= ours - unpacked < 2 * mask
    assert saved(position_ids=pos) - unpacked >= 4 * mask


def test_the_planner_counts_the_mask(tmp_path):
    """planner/footprint.py::document_mask: model=hf's additive mask, b x s x s in the
    attention's dtype; the project's decoder plans FlexAttention's block mask (GPUs)."""
    from launcher.planner import plan as planner
    from launcher.planner.footprint import activations
    from tests.helpers.hf_models import tiny_llama_config

    hf = ["model=hf", f"model.config={tiny_llama_config(tmp_path / 'llama')}"]
    for model, b, s, want in ((["model=gpt_tiny"], 2, 256, 16 * 2 * 2**2), (hf, 2, 256, 2 * 2 * 256 * 256)):
        base = model + ["recipe=fsdp", "precision=bf16", f"train.micro_batch={b}", f"train.seq_len={s}"]
        plain, masked = (cli.compose_config(base + [f"data.document_masking={on}"])[0] for on in ("false", "true"))
        figures = [activations(cfg, planner.layout_for(cfg, 2), ACMode.full, b) for cfg in (plain, masked)]
        assert figures[1] - figures[0] == want, model

"""data=chat end to end, in one launch: the shipped example prepared through the shared
cache, packed windows read by two ddp ranks, the loss on the assistant's tokens only (the
pretrained model's masked loss at step 1, computed here with transformers), val/loss on
the held-out windows' assistant tokens (the final weights' masked loss, computed here),
and the data/* metrics, counted here from the same windows.

data.document_masking=false here: a packed window attends across its samples (2-tuples,
targets -100), as transformers computes it below; the block-causal path (positions) is
tests/e2e/test_lora_runs.py's chat run and tests/e2e/test_packing_runs.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from chat_data import EXAMPLE, chat_model
from runs import launch, read_metrics

from launcher import config as C
from launcher.data.read import IGNORE, Held, build_dataset, micro_batch

SEQ, MB, G = 64, 4, 8
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    model = chat_model()
    run_dir = tmp_path_factory.mktemp("chat") / "run"
    proc = launch(
        "recipe=ddp",
        "model=hf",
        f"model.pretrained={model}",
        "data=chat",
        f"data.files={EXAMPLE}",
        f"data.tokenizer={model}",
        "data.document_masking=false",
        "data.val_fraction=0.05",
        f"train.seq_len={SEQ}",
        f"train.micro_batch={MB}",
        f"train.global_batch={G}",
        "train.steps=3",
        "optim.warmup_steps=1",
        "train.eval_every=3",
        "train.eval_samples=8",
        "logger=none",
        "logger.log_every=1",
        run_dir=run_dir,
    )
    return run_dir, model, proc.stdout


def masked_loss(model, batch: torch.Tensor) -> tuple[float, int, float]:
    """transformers' model on a batch of windows: the summed loss on the counted targets,
    their count, and the mean loss on every target."""
    inputs, targets = micro_batch(batch, document_masking=False)
    with torch.no_grad():
        logits = model(input_ids=inputs).logits.float().flatten(0, 1)
    return (
        torch.nn.functional.cross_entropy(logits, targets.flatten(), ignore_index=IGNORE, reduction="sum").item(),
        int((targets != IGNORE).sum()),
        torch.nn.functional.cross_entropy(logits, batch[:, 0, 1:].flatten()).item(),
    )


def per_rank(model, batches: list[torch.Tensor]) -> tuple[float, float]:
    """The loss the run logs: the mean over every counted target of the step, all ranks'
    (not a mean of each micro-batch's mean), and the mean over every target."""
    losses = [masked_loss(model, b) for b in batches]
    return sum(s for s, _, _ in losses) / sum(n for _, n, _ in losses), sum(a for _, _, a in losses) / len(losses)


def test_chat_trains_on_the_assistant_tokens_of_packed_windows(run):
    from transformers import AutoModelForCausalLM

    run_dir, folder, stdout = run
    assert "data: 3,000 conversations" in stdout and "counted in the loss: data.train_on=assistant" in stdout
    pointer = json.loads((run_dir / "data" / "chat.json").read_text())
    index = json.loads((Path(pointer["dir"]) / "index.json").read_text())
    assert index["kind"] == "chat" and index["documents"] == 3000 and 0 < index["counted"] < index["tokens"]

    cfg = C.load_frozen(run_dir)
    data = build_dataset(cfg, run_dir)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for step, row in enumerate(rows):  # the host counts against the windows of each step
        windows = data.__getitems__(list(range(step * G, (step + 1) * G)))
        assert row["data/tokens_seen"] == G * SEQ
        assert row["data/tokens_trained"] == int(windows[:, 1, 1:].count_nonzero())
        real = sum(int(data.packed.real[data._window(i)]) for i in range(step * G, (step + 1) * G))
        assert row["data/packing_efficiency"] == pytest.approx(real / (G * (SEQ + 1)), rel=1e-12)
        assert 0.5 < row["data/packing_efficiency"] <= 1 and row["data/tokens_trained"] < G * SEQ / 2

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    step1 = [data.__getitems__(list(range(r * MB, (r + 1) * MB))) for r in range(2)]
    assistant, every = per_rank(model, step1)
    # fp32, the same weights: 5e-8 apart measured; the loss over every token is 4e-4 away
    assert rows[0]["loss"] == pytest.approx(assistant, rel=1e-6) and abs(every / rows[0]["loss"] - 1) > 1e-4

    # val/loss: the final weights on the held-out windows' assistant tokens
    state = torch.load(run_dir / "checkpoints" / "step_00000003" / "engine" / "model.pt", weights_only=True)
    model.load_state_dict(state)
    held = Held(data, data.windows, data.held_out)
    val = [held.__getitems__(list(range(r * MB, (r + 1) * MB))) for r in range(2)]
    assert rows[-1]["val/loss"] == pytest.approx(per_rank(model, val)[0], rel=1e-5)


def test_the_step_is_the_mean_over_its_counted_tokens_whatever_the_micro_batch(run, tmp_path):
    """The same 3 steps with half the micro-batch and twice the accumulation: the same losses
    and gradient norms, since every loss divides by the step's counted targets (all ranks),
    not by its own micro-batch's (which weights a micro-batch of few counted tokens up)."""
    run_dir, model, _ = run
    other = tmp_path / "half"
    launch(
        "recipe=ddp",
        "model=hf",
        f"model.pretrained={model}",
        "data=chat",
        f"data.files={EXAMPLE}",
        f"data.tokenizer={model}",
        "data.document_masking=false",
        "data.val_fraction=0.05",
        f"train.seq_len={SEQ}",
        f"train.micro_batch={MB // 2}",
        f"train.global_batch={G}",
        "train.steps=3",
        "optim.warmup_steps=1",
        "train.eval_every=3",
        "train.eval_samples=8",
        "logger=none",
        "logger.log_every=1",
        "checkpoint.every=0",
        run_dir=other,
    )
    a, b = read_metrics(run_dir), read_metrics(other)
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=1e-5)
    assert [r["grad_norm"] for r in b] == pytest.approx([r["grad_norm"] for r in a], rel=1e-4)
    assert b[-1]["val/loss"] == pytest.approx(a[-1]["val/loss"], rel=1e-5)

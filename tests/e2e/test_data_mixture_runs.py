"""data.sources on real ranks: two token files mixed 0.7/0.3 by 2 ranks; each source's
tokens drawn in metrics.jsonl and the W&B run file, matching the blend; the small source
read to its end and its new epoch said on the console; each source's held-out windows
evaluated on its own (val/<name>/loss) and by weight (val/loss)."""

from __future__ import annotations

import numpy as np
import pytest
import wandb_file
from runs import launch, read_metrics

SEQ = 64


@pytest.mark.slow
def test_two_sources_mixed_by_weight_on_two_ranks(run_dir, tmp_path):
    (np.arange(800 * SEQ + 1) % 200).astype(np.uint16).tofile(tmp_path / "web.bin")
    (np.arange(40 * SEQ + 1) % 50 + 200).astype(np.uint16).tofile(tmp_path / "code.bin")  # 40 windows, 36 trained
    proc = launch(
        "data=memmap",
        f"data.sources='70 {tmp_path / 'web.bin'} 30 {tmp_path / 'code.bin'}'",
        f"train.seq_len={SEQ}",
        "train.steps=8",
        "optim.warmup_steps=1",
        "logger.log_every=4",
        "logger.mode=offline",
        "logger.system_metrics_s=0",
        "data.val_fraction=0.1",
        "train.eval_every=8",
        "train.eval_samples=16",
        run_dir=run_dir,
    )
    assert (
        "data: source code read to its end (36 sequences an epoch) by step 8: epoch 2 runs in a fresh order"
        in proc.stdout
    ), proc.stdout[-3000:]
    rows = {r["step"]: r for r in read_metrics(run_dir)}
    for step in (4, 8):
        web, code = rows[step]["data/web/tokens"], rows[step]["data/code/tokens"]
        assert web + code == step * 16 * SEQ  # 16 sequences a step (8 x 2 ranks)
        assert abs(code / (web + code) - 0.3) <= 1 / (step * 16)  # within one sample of its share
    # each source's held-out windows evaluated on their own; val/loss their weighted mean
    web, code = rows[8]["val/web/loss"], rows[8]["val/code/loss"]
    assert np.isfinite([web, code]).all() and web != code
    assert rows[8]["val/loss"] == pytest.approx(0.7 * web + 0.3 * code, rel=1e-6)
    (run,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    history = {h["_step"]: h for h in wandb_file.history(run)}
    assert [history[s]["data/code/tokens"] for s in (4, 8)] == [
        rows[4]["data/code/tokens"],
        rows[8]["data/code/tokens"],
    ]

    # Resumed with other weights: the checkpoint recorded the blend it trained with, so the
    # change in order is said, not silent.
    proc = launch(
        "data=memmap",
        f"data.sources='60 {tmp_path / 'web.bin'} 40 {tmp_path / 'code.bin'}'",
        f"train.seq_len={SEQ}",
        "train.steps=9",
        "optim.warmup_steps=1",
        "logger.log_every=4",
        "logger.mode=offline",
        "logger.system_metrics_s=0",
        "data.val_fraction=0.1",
        run_dir=run_dir,
    )
    said = next(line for line in proc.stdout.splitlines() if line.startswith("data: "))
    assert (
        said.startswith(
            f"data: {run_dir / 'checkpoints' / 'step_00000008'} was saved reading web 0.7: feistel "
            "720+80 windows of 64 in 1 file(s); code 0.3: feistel 36+4 windows"
        )
        and "this launch reads web 0.6: " in said
        and "from sample 128 on, the order is not the one the run trained" in said
    )

"""train.eval_every's held-out samples (launcher/data/read.py): a token file's last
data.val_fraction of windows never train and are what validation reads, in file order;
data.val_path is read whole; synthetic data holds out indices training never reaches.
The evaluation itself, through every engine: tests/e2e/test_parallel_train.py and test_zero.py."""

from __future__ import annotations

import numpy as np
import torch

from launcher.data.read import Held, MarkovSource, TokenFile, build_val_dataset, write_tokens
from launcher.launch.compose import compose_config


def _cfg(*more):
    cfg, _, _ = compose_config(["train.seq_len=8", "logger=none", *more])
    return cfg


def test_a_token_files_held_out_windows_never_train_and_are_what_validation_reads(tmp_path):
    path = tmp_path / "tokens.bin"
    write_tokens(np.arange(10 * 8 + 1) % 60000, path)  # 10 windows of 8 (+1 for the last target)
    cfg = _cfg("data=memmap", f"data.path={path}", "data.val_fraction=0.2", "data.vocab_size=60000")
    train = TokenFile(cfg.data, 8, seed=0)
    assert (train.windows, train.held_out) == (8, 2)
    starts = {int(train[i][0]) // 8 for i in range(3 * train.windows)}  # three epochs, every order
    assert starts == set(range(8)), "training read a held-out window"
    val = build_val_dataset(cfg, train)
    got = val.__getitems__([0, 1, 2])
    assert [int(row[0]) // 8 for row in got] == [8, 9, 8]  # the tail windows, in file order, cycled
    assert torch.equal(got[0], torch.arange(64, 73))  # window 8 and its next token

    own = tmp_path / "val.bin"
    write_tokens(np.arange(3 * 8 + 1) + 1000, own)
    cfg = _cfg("data=memmap", f"data.path={path}", f"data.val_path={own}", "data.vocab_size=60000")
    train = TokenFile(cfg.data, 8, seed=0)
    assert train.held_out == 0 and train.windows == 10  # a file of its own takes nothing from training
    assert [int(r[0]) for r in build_val_dataset(cfg, train).__getitems__([0, 1, 2, 3])] == [1000, 1008, 1016, 1000]


def test_synthetic_data_holds_out_indices_training_never_draws():
    cfg = _cfg()
    source = MarkovSource(cfg.data, 8)
    val = build_val_dataset(cfg, source)
    assert isinstance(val, Held)
    assert torch.equal(val.__getitems__([0, 5]), source.__getitems__([2**61, 2**61 + 5]))
    assert not torch.equal(val.__getitems__([0]), source.__getitems__([0]))

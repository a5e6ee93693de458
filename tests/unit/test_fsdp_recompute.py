"""FSDP2 with activation checkpointing in bf16 under the torch that clusters bring. Before
torch 2.13, FSDP's pre-forward hook does not cast a block's inputs to the compute dtype
when backward recomputes the block (2.13 does). The H200 run on torch 2.11 failed there:
the rotary table was saved in bf16 in forward and recomputed in fp32 (CheckpointError).
Here torch 2.13's hook is given 2.11's behaviour for the recomputation, and a real
one-rank fsdp step must run and match the step of the unchanged hook."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState, TrainingState

from launcher import models
from launcher.data.read import build_dataset
from launcher.launch.compose import compose_config
from launcher.rank.entry import build_engine


def _older_pre_forward(original):
    def pre_forward(self, module, args, kwargs):  # torch 2.11's: unshard, the inputs as they are
        if self._training_state == TrainingState.PRE_BACKWARD:
            for group in self._fsdp_param_groups:
                if not group.is_unsharded:
                    group.unshard()
                    group.wait_for_unshard()
            return args, kwargs
        return original(self, module, args, kwargs)

    return pre_forward


def _step_loss(cfg, tmp_path) -> float:
    torch.manual_seed(0)
    net = models.prepare(models.on_meta(cfg), cfg)
    engine = build_engine(cfg, net, torch.device("cpu"), 0, 1, 0, tmp_path)
    b = build_dataset(cfg).__getitems__(list(range(cfg.train.micro_batch)))
    return float(engine.train_step([(b[:, :-1], b[:, 1:])]).loss)


@pytest.mark.parametrize("ac", ["full", "op"])
def test_fsdp_recomputes_in_bf16_under_an_older_torch(one_rank_group, tmp_path, monkeypatch, ac):
    cfg, _, _ = compose_config(
        [
            "recipe=fsdp",
            "model=gpt_tiny",
            "precision=bf16",
            "train.seq_len=64",
            "train.micro_batch=2",
            f"train.activation_checkpointing={ac}",
            "logger=none",
            "cluster.nproc_per_node=1",
        ]
    )
    current = _step_loss(cfg, tmp_path / "a")
    monkeypatch.setattr(FSDPState, "_pre_forward", _older_pre_forward(FSDPState._pre_forward))
    assert _step_loss(cfg, tmp_path / "b") == current

"""Distributed checkpoints (torch.distributed.checkpoint) for the recipes that split the
model: fsdp, tp, tp_fsdp, pp. Written under the engine folder the Checkpointer gives
(its atomic rename, manifest, `latest` and keep-K cover these files like any other).

    engine/.metadata, engine/__R_0.distcp   DCP: each rank writes its own shards of the
                                            model and the Adam states, keyed by the full
                                            model's parameter names
    engine/scheduler.pt                     the LR schedule (rank 0; weights_only load)

DCP records every tensor's global shape and where each shard lies, so a load at another
layout (other world size, FSDP <-> TP <-> pipeline stages, one process) reads the pieces
each rank now needs: that is the resharding. Only tensors go into DCP (DCP would load
other objects with pickle); DCP's own .metadata file is its pickle format. A tied head
is stored once, as `tok_embeddings.weight`, whichever rank holds it under which name.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from launcher.config import Config
from launcher.models.gpt import GPT

OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)  # keys "state.<fqn>.<exp_avg|...>"
TIED = ("output.weight", "tok_embeddings.weight")


def _canonical(state: dict[str, torch.Tensor], tied: bool, prefix: str = "") -> dict[str, torch.Tensor]:
    """The same tensors, a tied head under the embedding's name (once)."""
    head, embed = prefix + TIED[0], prefix + TIED[1]
    out = {}
    for key, value in state.items():
        if tied and key.startswith(head):
            key = embed + key[len(head):]
        out.setdefault(key, value)
    return out


def _tensors(model: nn.Module, optimizer: torch.optim.Optimizer, tied: bool):
    """(model state, optimizer state, what goes into DCP): the first two are the live
    tensors (DCP loads in place into them), the third is their canonical, tensor-only view."""
    model_sd = get_model_state_dict(model)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=OPTIM)  # initialises Adam's state if empty
    saved = {"model": _canonical(model_sd, tied),
             "optim": _canonical({k: v for k, v in optim_sd.items() if k.startswith("state.")}, tied, "state.")}
    return model_sd, optim_sd, saved


def save(path: Path, model: nn.Module, optimizer, scheduler, tied: bool, rank: int) -> None:
    """Called on every rank."""
    _, _, saved = _tensors(model, optimizer, tied)
    dcp.save(saved, checkpoint_id=str(path))
    if rank == 0:
        torch.save({"scheduler": scheduler.state_dict()}, path / "scheduler.pt")


def load(path: Path, model: nn.Module, optimizer, scheduler, tied: bool) -> None:
    model_sd, optim_sd, wanted = _tensors(model, optimizer, tied)
    dcp.load(wanted, checkpoint_id=str(path))
    set_model_state_dict(model, model_sd)
    set_optimizer_state_dict(model, optimizer, optim_sd, options=OPTIM)
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", map_location="cpu", weights_only=True)["scheduler"])
    # The LR lives in the optimizer's param groups, which DCP does not hold: the schedule sets it.
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr


def consolidate(cfg: Config, engine_dir: Path) -> dict[str, torch.Tensor]:
    """Full fp32 weights on one process, no process group (export): DCP reads every
    shard into the full model's tensors."""
    with torch.device("meta"):
        model = GPT(cfg.model)
    model.to_empty(device="cpu")  # storage without the cost of initialising it
    if cfg.model.tie_embeddings:  # to_empty gave each module its own tensor: tie them again
        model.output.weight = model.tok_embeddings.weight
    state = model.state_dict()
    dcp.load({"model": _canonical(state, cfg.model.tie_embeddings)}, checkpoint_id=str(engine_dir), no_dist=True)
    return {k: v.float() for k, v in state.items()}

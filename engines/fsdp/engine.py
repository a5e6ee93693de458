"""`ShardedEngine`, the engine of `fsdp`, `tp` and `tp_fsdp` (their specs:
engines/fsdp/__init__.py, engines/tp.py, engines/tp_fsdp.py): the meta-device model
parallelized for the run's degrees (launcher.parallel.mesh.parallelize), then only this
rank's shards allocated; one step, DCP checkpoints and the memory count for all three."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import engines
from launcher import models
from launcher.device import autocast_dtype
from launcher.models import model_layout
from launcher.parallel import dcp
from launcher.parallel import degrees as D
from launcher.parallel.mesh import allreduce_grads, build_mesh, clip_grad_norm, match_grad_layouts, parallelize
from launcher.rank.engine import (
    BuildContext,
    Engine,
    MemoryBreakdown,
    StepResult,
    autocast,
    build_optimizer,
    build_scheduler,
    evaluate,
    optimizer_state_bytes,
    tensor_bytes,
)


class ShardedEngine(Engine):
    def __init__(self, ctx: BuildContext):
        cfg = ctx.cfg
        self.cfg, self.device, self.rank = cfg, ctx.device, ctx.rank
        self.deg = D.degrees(cfg, ctx.world_size)
        mesh = build_mesh(self.deg, ctx.device)
        # Parallelize the meta-device model, then allocate only this rank's shards.
        self.sharded = engines.spec(cfg.recipe.engine).parallelism.shards
        self.model = ctx.model
        parallelize(self.model, mesh, self.deg, cfg)
        offload = self.sharded and cfg.recipe.fsdp.cpu_offload
        models.materialize(self.model, cfg, ctx.device, storage=torch.device("cpu") if offload else None)
        # FSDP's mixed-precision policy casts the parameters; without FSDP, autocast does it.
        self.dtype = None if self.sharded else autocast_dtype(cfg.precision.name.value)
        # Replicas that do not shard (tp with world > tp) average gradients themselves.
        self.dp_group = None if self.sharded or self.deg.dp == 1 else mesh["dp_replicate"].get_group()
        self.params = list(dict.fromkeys(p for p in self.model.parameters() if p.requires_grad))
        # model.lora's base, its shards as they are now: between steps the modules may hold FSDP2's unsharded
        # root parameters (gpt_tiny on 2 ranks: 65,792 bytes more than the shards at step 6)
        self.frozen = list(dict.fromkeys(p for p in self.model.parameters() if not p.requires_grad))
        self.optimizer = build_optimizer(self.model, cfg.optim, ctx.device)
        self.scheduler = build_scheduler(self.optimizer, cfg)
        self.clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
        # Tensor-parallel ranks compute the same loss: one of them reports it.
        self.loss_owner = mesh["tp"].get_local_rank() == 0
        self.grad_bytes = 0
        where = "cpu" if offload else "device"
        self.where = {"params": where, "grads": where, "optim": where}

    def train_step(self, micro_batches) -> StepResult:
        n = len(micro_batches)
        total = torch.zeros((), device=self.device)
        for batch in micro_batches:  # (inputs, targets[, positions])
            # FSDP reduce-scatters after every micro-batch's backward and accumulates the
            # sharded gradients: the full gradient is never held, at n reduce-scatters a step.
            with autocast(self.device, self.dtype):
                loss = self.model(*batch)
            (loss / n).backward()
            total += loss.detach()
        if not self.sharded:
            match_grad_layouts(self.params)
        if self.dp_group is not None:
            allreduce_grads(self.params, self.dp_group, self.deg.dp)
        grad_norm = clip_grad_norm(self.params, self.clip)
        if not self.grad_bytes:  # held from backward to here; the same shards every step: counted once
            self.grad_bytes = tensor_bytes(p.grad for p in self.params)
        if self.guard.admit(total / n, self.loss_owner, grad_norm):  # train.max_bad_steps
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return StepResult(loss=total / n, grad_norm=grad_norm, loss_owner=self.loss_owner)

    def eval_step(self, micro_batches) -> StepResult:
        return evaluate(self.model, micro_batches, self.device, self.dtype, self.loss_owner)

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def state_bytes(self) -> MemoryBreakdown:
        """This rank's shards: parameters, the gradients as they stood at the last
        optimizer step (freed after it), and the optimizer states."""
        return MemoryBreakdown(
            params=tensor_bytes(self.params) + tensor_bytes(self.frozen),
            grads=self.grad_bytes,
            optim=optimizer_state_bytes(self.optimizer),
            where=dict(self.where),
        )

    # -------------------------------------------------------------------------- state
    def save(self, path: Path, staging=None):
        return dcp.save(
            path, self.model, self.optimizer, self.scheduler, model_layout(self.model).tied_names(), self.rank, staging
        )

    def warm(self, staging):
        return dcp.warm(self.model, self.optimizer, model_layout(self.model).tied_names(), staging)

    def load(self, path: Path) -> None:
        dcp.load(path, self.model, self.optimizer, self.scheduler, self.cfg)

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        return {k: v.detach().float().cpu() for k, v in full.items()}


def build(ctx: BuildContext) -> ShardedEngine:
    return ShardedEngine(ctx)


def consolidate(cfg, engine_dir: Path) -> dict[str, torch.Tensor]:
    return dcp.consolidate(cfg, engine_dir)

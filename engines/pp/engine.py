"""The `pp` and `pp_fsdp` engine (the recipes' specs and design: engines/pp/__init__.py,
engines/pp_fsdp.py): the meta-device model cut into this rank's stages, each made tensor
parallel and sharded with FSDP2 where the degrees say, a torch.distributed.pipelining
schedule over them, the tied embedding's two copies kept equal, DCP checkpoints under the
full model's names."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

import engines
from launcher import config as C
from launcher import models
from launcher.device import autocast_dtype
from launcher.models import Layout, model_layout, model_shape
from launcher.models.gpt import lm_loss
from launcher.models.init import is_dtensor
from launcher.parallel import dcp
from launcher.parallel import degrees as D
from launcher.parallel.cuts import Stage, apply_tp, stage_bounds
from launcher.parallel.mesh import allreduce_grads, apply_fsdp, build_mesh, clip_grad_norm, match_grad_layouts
from launcher.rank.engine import (
    BuildContext,
    Engine,
    MemoryBreakdown,
    StepResult,
    autocast,
    build_optimizer,
    build_scheduler,
    local_shard,
    optimizer_state_bytes,
    tensor_bytes,
)

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


class PipelineEngine(Engine):
    def __init__(self, ctx: BuildContext):
        cfg, p = ctx.cfg, ctx.cfg.parallel
        self.cfg, self.device, self.rank = cfg, ctx.device, ctx.rank
        self.deg = D.degrees(cfg, ctx.world_size)
        mesh = build_mesh(self.deg, ctx.device)
        pp_rank = mesh["pp"].get_local_rank()
        n_stages = C.pipeline_stages(p)
        self.bounds = stage_bounds(model_shape(cfg), n_stages, p.pp_split)
        mine = list(range(pp_rank, n_stages, self.deg.pp))
        full = ctx.model  # on the meta device: cut first, then allocate only this rank's layers
        self.layout = model_layout(full)
        layers = [i for s in mine for i in range(*self.bounds[s])]
        self.first, self.last = 0 in mine, n_stages - 1 in mine
        _drop_the_rest(full, self.layout, layers, self.first, self.last)
        self.model = Stage(full, layers)  # all this rank holds, under the full model's names
        # Each stage the schedule runs: tensor parallel inside it, then FSDP with the stage
        # as its root (the schedule defers FSDP's gradient reduction to the step's last
        # micro-batch only for a stage module that is an FSDP module).
        chunks = [Stage(full, range(*self.bounds[s])) for s in mine]
        self.sharded = engines.spec(cfg.recipe.engine).parallelism.shards
        for chunk in chunks:
            if self.deg.tp > 1:
                apply_tp(chunk, mesh["tp"], p.sequence_parallel)
            if self.sharded:
                apply_fsdp(chunk, mesh["dp_shard"], cfg, mesh.device_type)
        models.materialize(full, cfg, ctx.device)
        self.stages = [
            PipelineStage(chunk, s, n_stages, ctx.device, group=mesh["pp"].get_group())
            for chunk, s in zip(chunks, mine)
        ]

        schedule = SCHEDULES[p.pp_schedule.value]
        target = self.stages if schedule is ScheduleInterleaved1F1B else self.stages[0]
        self.schedule = schedule(target, n_microbatches=p.pp_microbatches, loss_fn=lm_loss)
        # FSDP's mixed-precision policy casts the parameters; without FSDP, autocast does it.
        self.dtype = None if self.sharded else autocast_dtype(cfg.precision.name.value)
        self.dp_group = mesh["dp_replicate"].get_group() if self.deg.dp_replicate > 1 else None
        self.tied_group, self.head_copy = self._tie(cfg)
        # The last stage's tensor-parallel ranks compute the same loss: one of them reports it.
        self.loss_owner = self.last and mesh["tp"].get_local_rank() == 0

        self.params = list(dict.fromkeys(q for q in self.model.parameters() if q.requires_grad))
        self.optimizer = build_optimizer(self.model, cfg.optim, ctx.device)
        self.scheduler = build_scheduler(self.optimizer, cfg)
        self.clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
        self.grad_bytes = 0

    def _tie(self, cfg: C.Config):
        """The groups joining the first and the last stage of a tied embedding: one for each
        position in a stage (data-parallel replica, FSDP shard, tensor-parallel rank), whose
        two copies are sharded alike (every rank creates every group, in the same order);
        and this rank's head copy."""
        if not self.layout.tied:
            return None, None
        mine = None
        per_stage = self.deg.world // self.deg.pp
        for i in range(per_stage):
            pair = [i, (self.deg.pp - 1) * per_stage + i]
            group = dist.new_group(pair)
            if self.rank in pair:
                mine = group
        tied = self._tied_weight()
        return (mine if tied is not None else None), (tied if self.last else None)

    def _tied_weight(self):
        """This rank's copy of a tied embedding/head (the first stage's embedding, the last's head)."""
        part = self.layout.embed if self.first else self.layout.head if self.last else None
        return self.model.get_submodule(part).weight if part else None

    @property
    def output_module(self):
        """The module that makes this rank's output, its last stage (debug.fault=nan_loss
        and spike hook it; `model` is never called as a whole)."""
        return self.stages[-1].submod

    def _inputs(self, micro_batches, losses: list) -> tuple[tuple, dict]:
        """The schedule's arguments for this rank's whole batch: the tokens (first stage),
        targets and the list of losses (last stage), and packed samples' positions (every
        stage: the schedule splits keyword inputs into the same micro-batches as the tokens
        and hands each stage its chunk, so the positions go beside the hidden states, never
        through the stages' sends, and need no gradient)."""
        x, y, *positions = (torch.cat(part) for part in zip(*micro_batches))
        kwargs = {"target": y, "losses": losses} if self.last else {}
        if positions:
            kwargs["positions"] = positions[0]
        return ((x,) if self.first else ()), kwargs

    def train_step(self, micro_batches) -> StepResult:
        # One pass of the schedule over this data-parallel rank's whole batch.
        losses: list[torch.Tensor] = []
        args, kwargs = self._inputs(micro_batches, losses)
        with autocast(self.device, self.dtype):
            self.schedule.step(*args, **kwargs)
        if not self.sharded and self.deg.tp > 1:
            match_grad_layouts(self.params)
        if self.tied_group is not None:  # embedding + head gradients: the tied weight's gradient
            dist.all_reduce(local_shard(self._tied_weight().grad), group=self.tied_group)
        if self.dp_group is not None:
            allreduce_grads(self.params, self.dp_group, self.deg.dp_replicate)
        # A stage's plain tensors are held by its dp replicas (DTensors say their own
        # copies); the head copy is counted on the first stage.
        grad_norm = clip_grad_norm(
            self.params, self.clip, stages=self.deg.pp, copies=lambda q: 0 if q is self.head_copy else self.deg.dp
        )
        self.grad_bytes = tensor_bytes(q.grad for q in self.params)
        loss = torch.stack([v.detach() for v in losses]).mean() if self.last else torch.zeros((), device=self.device)
        if self.guard.admit(loss, self.loss_owner, grad_norm):  # train.max_bad_steps
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return StepResult(loss=loss, grad_norm=grad_norm, loss_owner=self.loss_owner)

    def eval_step(self, micro_batches) -> StepResult:
        """The schedule's forward-only pass (PipelineSchedule.eval) over the whole batch."""
        losses: list[torch.Tensor] = []
        args, kwargs = self._inputs(micro_batches, losses)
        self.model.eval()
        try:
            with torch.no_grad(), autocast(self.device, self.dtype):
                self.schedule.eval(*args, **kwargs)
        finally:
            self.model.train()
        zero = torch.zeros((), device=self.device)
        loss = torch.stack([v.detach().float() for v in losses]).mean() if self.last else zero
        return StepResult(loss=loss, grad_norm=zero, loss_owner=self.loss_owner)

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def state_bytes(self) -> MemoryBreakdown:
        """This rank's stage(s): parameters, the gradients as they stood at the last
        optimizer step, the Adam states."""
        return MemoryBreakdown(
            params=tensor_bytes(self.params), grads=self.grad_bytes, optim=optimizer_state_bytes(self.optimizer)
        )

    # -------------------------------------------------------------------------- state
    def save(self, path: Path, staging=None):
        return dcp.save(path, self.model, self.optimizer, self.scheduler, self.layout.tied_names(), self.rank, staging)

    def warm(self, staging):
        return dcp.warm(self.model, self.optimizer, self.layout.tied_names(), staging)

    def load(self, path: Path) -> None:
        dcp.load(path, self.model, self.optimizer, self.scheduler, self.cfg)

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        # Each stage's shards gathered within the stage (every rank of it walks the same
        # names in the same order), then the stages' tensors joined.
        mine = {
            k: (v.full_tensor() if is_dtensor(v) else v).detach().float().cpu()
            for k, v in self.model.state_dict().items()
        }
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
        full = {k: v for part in parts for k, v in part.items()}
        if self.layout.tied:
            head, embed = self.layout.tied_names()
            full[head] = full[embed]
        return full


def _drop_the_rest(model: nn.Module, layout: Layout, layers: list[int], first: bool, last: bool) -> None:
    """Replace what other stages hold by nothing, before anything is allocated (the full
    model exists only on the meta device)."""
    keep = set(layers)
    blocks = model.get_submodule(layout.layers)
    for i in range(len(blocks)):
        if i not in keep:
            blocks[i] = nn.Identity()
    if not first:
        model.set_submodule(layout.embed, nn.Identity())
    if not last:
        model.set_submodule(layout.norm, nn.Identity())
        model.set_submodule(layout.head, nn.Identity())


def build(ctx: BuildContext) -> PipelineEngine:
    return PipelineEngine(ctx)


def consolidate(cfg, engine_dir: Path) -> dict[str, torch.Tensor]:
    return dcp.consolidate(cfg, engine_dir)

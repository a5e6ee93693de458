"""The `ddp` engine (the recipe's spec is engines/ddp/__init__.py): DDP over the whole
model, gradient accumulation without all-reduce until the last micro-batch, the fp16
scaler, and the plain model.pt/optim.pt checkpoint. Under parallel.ep an MoE's experts are
split over ep ranks outside DDP (launcher/parallel/experts.py) and saved one file per ep rank."""

from __future__ import annotations

import contextlib
import gc
import inspect
import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from launcher import models
from launcher.device import autocast_dtype
from launcher.parallel import degrees as D
from launcher.parallel.context import attach
from launcher.parallel.experts import expert_param_names, join_expert_files, own_rows, shard_locally
from launcher.rank.engine import (
    BuildContext,
    Engine,
    MemoryBreakdown,
    StepResult,
    autocast,
    build_optimizer,
    build_scheduler,
    evaluate,
    load_trained,
    optimizer_state_bytes,
    tensor_bytes,
    trained_state,
)


def no_buffer_sync() -> dict:
    """DDP's keyword that skips syncing buffers before each forward: forward_sync_buffers
    from torch 2.13, broadcast_buffers before it (a site's torch 2.11 has only that one)."""
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


class DDPEngine(Engine):
    def __init__(self, ctx: BuildContext):
        cfg = ctx.cfg
        self.cfg, self.device, self.rank = cfg, ctx.device, ctx.rank
        deg = D.degrees(cfg, ctx.world_size)
        self.world, self.ep = ctx.world_size, deg.ep
        self.experts, self.expert_group = [], None
        if deg.ep > 1:  # the experts split over ep neighbours, the rest replicated (launcher/parallel/experts.py)
            self.expert_group = self._split_experts(ctx.model, ctx.device)
        self.module = models.materialize(ctx.model, cfg, ctx.device)  # replicated: built once, on the device
        if deg.cp > 1:  # the sequence split over cp ranks; DDP averages gradients over all (dp x cp)
            # local: start-up (torch.distributed.fsdp via launcher.parallel.mesh, 4.6 s)
            from launcher.parallel.mesh import build_mesh

            attach(self.module, build_mesh(deg, ctx.device)["cp"].get_group())
        self.local_rank = ctx.local_rank
        self.model = self._wrap()
        self.stepping = False  # inside the optimizer step: a failure there cannot be discarded
        self.optimizer = build_optimizer(self.module, cfg.optim, ctx.device)
        self.scheduler = build_scheduler(self.optimizer, cfg)
        self.dtype = autocast_dtype(cfg.precision.name.value)
        self.scaler = None
        if cfg.precision.name.value == "fp16":
            p = cfg.precision
            self.scaler = torch.amp.GradScaler("cuda", init_scale=p.initial_scale, growth_interval=p.growth_interval)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        if deg.ep > 1:
            self.experts = [self.module.get_parameter(n) for n in expert_param_names(self.module)]
        self.clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf

    def train_step(self, micro_batches) -> StepResult:
        n = len(micro_batches)
        total = torch.zeros((), device=self.device)
        for i, batch in enumerate(micro_batches):  # (inputs, targets[, positions])
            # Only the last micro-batch all-reduces; the others accumulate locally.
            sync = contextlib.nullcontext() if i == n - 1 else self.model.no_sync()
            with sync:
                with autocast(self.device, self.dtype):
                    loss = self.model(*batch)
                scaled = loss / n
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            total += loss.detach()
        skipped, scale = False, None
        self.stepping = True
        if self.expert_group is not None:  # DDP left them out: averaged over the ranks that hold them
            # local: start-up (torch.distributed.fsdp via launcher.parallel.mesh, 4.6 s)
            from launcher.parallel.mesh import allreduce_grads

            allreduce_grads(self.experts, self.expert_group, self.world)
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        grad_norm = self._clip()
        apply = self.guard.admit(total / n, True, grad_norm)  # train.max_bad_steps
        if self.scaler:
            # The scale as a device tensor (get_scale() would read it to the host, a sync
            # every step): the scaler lowers it exactly when it skips the step.
            before = self.scaler._get_scale_async().clone()
            if apply:
                self.scaler.step(self.optimizer)
            self.scaler.update()
            scale = self.scaler._get_scale_async()
            skipped = scale < before
        elif apply:
            self.optimizer.step()
        # With bucket views the gradients stay allocated (they are the buckets): zero them.
        self.optimizer.zero_grad(set_to_none=not self.cfg.recipe.ddp.gradient_as_bucket_view)
        self.scheduler.step()
        self.stepping = False
        return StepResult(loss=total / n, grad_norm=grad_norm, skipped=skipped, loss_scale=scale)

    def _split_experts(self, model, device) -> dist.ProcessGroup:
        """parallel.ep: groups of ep neighbouring ranks split the experts; the ranks at one
        position of every group hold the same ones. DDP is told to leave the experts alone.
        Returns the group of ranks holding this rank's experts."""
        mesh = init_device_mesh(device.type, (self.world // self.ep, self.ep), mesh_dim_names=("efsdp", "ep"))
        shard_locally(model, mesh["ep"].get_group())
        DDP._set_params_and_buffers_to_ignore_for_model(model, expert_param_names(model))
        self.ep_rank, self.ep_group = mesh.get_local_rank("ep"), mesh["ep"].get_group()
        self.expert_holder = mesh.get_local_rank("efsdp") == 0  # writes its experts at a save
        return mesh["efsdp"].get_group()

    def _clip(self) -> torch.Tensor:
        """The global gradient norm, clipped. Under ep the experts' gradients differ between
        ep ranks: each is counted once over the world (launcher/parallel/mesh.py)."""
        if self.expert_group is None:
            return torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        # local: start-up (torch.distributed.fsdp via launcher.parallel.mesh, 4.6 s)
        from launcher.parallel.mesh import clip_grad_norm

        experts = {id(p) for p in self.experts}
        return clip_grad_norm(
            self.params, self.clip, lambda p: self.world // self.ep if id(p) in experts else self.world
        )

    def _wrap(self) -> DDP:
        opts = self.cfg.recipe.ddp
        return DDP(
            self.module,
            device_ids=[self.local_rank] if self.device.type == "cuda" else None,
            bucket_cap_mb=opts.bucket_cap_mb,
            gradient_as_bucket_view=opts.gradient_as_bucket_view,
            static_graph=opts.static_graph,
            **no_buffer_sync(),  # the only buffer (the rotary table) is identical everywhere
        )

    def can_discard_step(self) -> bool:
        """A step that failed before its optimizer step: no parameter has moved."""
        return not self.stepping

    def discard_step(self) -> None:
        """After a step that failed before its optimizer step (out of memory under
        train.oom_backoff, one rank): drop its gradients and wrap the module in DDP again (a
        forward or backward that stopped part-way leaves DDP's reducer waiting for the rest)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.model = None  # the old reducer's buckets go before the new one's are made
        gc.collect()
        self.model = self._wrap()

    def eval_step(self, micro_batches) -> StepResult:
        return evaluate(self.model, micro_batches, self.device, self.dtype)

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def state_bytes(self) -> MemoryBreakdown:
        params = tensor_bytes(self.module.parameters())  # frozen ones too (model.lora: the base)
        grads = tensor_bytes(p.grad for p in self.params)
        if not self.cfg.recipe.ddp.gradient_as_bucket_view:
            grads *= 2  # DDP's reducer keeps its own bucket copy of every gradient
        if grads == 0:  # before the first backward: the buckets DDP will fill
            grads = tensor_bytes(self.params)
        return MemoryBreakdown(params=params, grads=grads, optim=optimizer_state_bytes(self.optimizer))

    # -------------------------------------------------------------------------- state
    def save(self, path: Path, staging=None):
        """Replicated state: rank 0 writes it once; under parallel.ep the experts are each ep
        rank's own, written by the ranks of the first group (expert files). With `staging`
        (an async save): a host copy now, and the function that writes it."""
        if not self._files(meta=True):
            return (lambda: None) if staging is not None else None
        files = self._files() if staging is None else staging.staged(self._files())

        def write() -> None:
            path.mkdir(parents=True, exist_ok=True)
            for name, state in files.items():
                torch.save(state, path / name)

        if staging is not None:
            return write
        write()

    def _files(self, meta: bool = False) -> dict:
        """This rank's files: rank 0 the model (less the experts under ep) and the optimizer;
        under ep, the holders of each ep rank's experts (the first group) those experts and
        their optimizer states (`experts_file`). `meta`: only the names."""
        names = (["model.pt", "optim.pt"] if self.rank == 0 else []) + (
            [experts_file(self.ep_rank, self.ep)] if self.expert_group is not None and self.expert_holder else []
        )
        if meta or not names:
            return dict.fromkeys(names)
        experts = set(expert_param_names(self.module)) if self.expert_group is not None else set()
        optimizer = self.optimizer.state_dict()
        files = {}
        if self.rank == 0:
            model = {k: v for k, v in trained_state(self.module).items() if k not in experts}
            files["model.pt"] = model
            files["optim.pt"] = {
                "optimizer": optimizer,
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler else None,
            }
        if len(names) > len(files):
            index = self._param_index()
            files[names[-1]] = {
                "model": {n: self.module.get_parameter(n).detach() for n in sorted(experts)},
                "optim": {
                    index[n]: optimizer["state"][index[n]] for n in sorted(experts) if index[n] in optimizer["state"]
                },
            }
        return files

    def _param_index(self) -> dict[str, int]:
        """Parameter name -> its index in the optimizer's state dict."""
        ids = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        return {n: ids[id(p)] for n, p in self.module.named_parameters() if id(p) in ids}

    def warm(self, staging):
        """checkpoint.async_save: the host copy of what save() stages, made once at start-up
        (its buffers are then reused: the first save's stall is the steady one)."""
        return staging.staged(self._files()) if self._files(meta=True) else None

    def load(self, path: Path) -> None:
        if not (path / "model.pt").is_file():  # written by fsdp, tp, tp_fsdp or pp: DCP, any layout
            # local: start-up (torch.distributed.checkpoint via launcher.parallel.dcp, 3.2 s)
            from launcher.parallel import dcp

            if self.expert_group is not None:
                raise RuntimeError(
                    f"{path} is a DCP checkpoint: ddp reads it at parallel.ep=1 only (its experts whole); "
                    f"resume it with recipe=fsdp at any ep"
                )

            dcp.load(path, self.module, self.optimizer, self.scheduler, self.cfg)
            dist.barrier()
            return
        model = torch.load(path / "model.pt", map_location=self.device, weights_only=True)
        state = torch.load(path / "optim.pt", map_location=self.device, weights_only=True)
        # Under ep, written at any ep: the experts joined, then this rank's taken (every rank reads them all once).
        join_expert_files(path, model, state["optimizer"]["state"])
        if self.expert_group is not None:
            index = self._param_index()
            for name in expert_param_names(self.module):
                model[name] = own_rows(model[name], self.ep, self.ep_rank)
                if index[name] in state["optimizer"]["state"]:
                    mine = state["optimizer"]["state"][index[name]]
                    state["optimizer"]["state"][index[name]] = {
                        k: own_rows(v, self.ep, self.ep_rank) for k, v in mine.items()
                    }
        load_trained(self.module, model)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        dist.barrier()

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """The full fp32 weights on every rank (under ep: the experts gathered over the ep ranks)."""
        full = {k: v.detach().float().cpu() for k, v in self.module.state_dict().items()}
        if self.expert_group is not None:
            for name in expert_param_names(self.module):
                local = self.module.get_parameter(name).detach().float().contiguous()
                parts = [torch.empty_like(local) for _ in range(self.ep)]
                dist.all_gather(parts, local, group=self.ep_group)
                full[name] = torch.cat(parts).cpu()
        return full


def experts_file(ep_rank: int, ep: int) -> str:
    """A ddp checkpoint's file of ep rank `ep_rank`'s experts under parallel.ep."""
    return f"experts-{ep_rank:05d}-of-{ep:05d}.pt"


def build(ctx: BuildContext) -> DDPEngine:
    return DDPEngine(ctx)


def consolidate(cfg, engine_dir: Path) -> dict[str, torch.Tensor]:
    """DDP checkpoints hold the whole model in one file; under parallel.ep the experts in
    one file per ep rank, joined here in expert order."""
    state = torch.load(engine_dir / "model.pt", map_location="cpu", weights_only=True)
    join_expert_files(engine_dir, state)
    return {k: v.float() for k, v in state.items()}

"""The one interface every engine implements, and the helpers engines share.

An engine's module (engines/<engine>) exposes `build(ctx) -> Engine`, a subclass of
`Engine`. The engine owns how micro-batches become one optimizer step (DDP with no_sync,
DeepSpeed's engine, a pipeline schedule); the loop only calls it. The base class is the contract and its
defaults; the rest engines share are the helpers below.
"""

from __future__ import annotations

import abc
import contextlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from launcher import optim
from launcher.config import Config, OptimConfig, lr_factor
from launcher.models.init import is_dtensor

# (inputs, targets), each (micro_batch, seq_len) int64, targets -100 where a token is not
# counted in the loss; with data.document_masking a third, positions, restarting at 0 where
# each packed sample starts: model(*batch) takes them all.
Batch = tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class StepResult:
    loss: torch.Tensor
    """Mean loss over this rank's micro-batches (a 0-d tensor; the loop reduces it
    across ranks only when it logs, to keep the device unsynchronised in between)."""
    grad_norm: torch.Tensor
    """Global gradient norm before clipping (the same on every rank)."""
    skipped: bool | torch.Tensor = False
    """fp16: the step was skipped because gradients overflowed (the loop counts them:
    `skipped_steps` in metrics.jsonl and summary.json). A 0-d bool tensor where reading it
    would synchronise the device."""
    loss_scale: float | torch.Tensor | None = None
    """fp16: the loss scale after this step (a float, or a 0-d tensor the loop reads when it logs)."""
    loss_owner: bool = True
    """This rank reports the loss of its data-parallel slice. Exactly one rank per slice
    does (the loop averages over data-parallel slices): ranks that hold the same loss
    (tensor parallel) or none (pipeline stages before the last) set it False. Under
    context parallel each rank of the slice's cp group reports the mean over its own
    positions, and the loop averages those too."""


@dataclass
class MemoryBreakdown:
    """Bytes this rank holds for the model state, by part and by place."""

    params: int = 0
    grads: int = 0
    optim: int = 0
    """Optimizer states, including fp32 master copies where the engine keeps them."""
    where: dict[str, str] = field(default_factory=lambda: {"params": "device", "grads": "device", "optim": "device"})
    """Where each part lives: "device", "cpu" (host memory: ZeRO offload) or "device+cpu"."""
    host: int = 0
    """Bytes of the total kept in host memory rather than on the device (offload)."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optim

    def as_metrics(self) -> dict[str, int]:
        return {
            "mem/params_bytes": self.params,
            "mem/grads_bytes": self.grads,
            "mem/optim_bytes": self.optim,
            "mem/model_state_bytes": self.total,
            "mem/host_bytes": self.host,
        }


@dataclass
class BuildContext:
    """Everything an engine's `build` needs."""

    cfg: Config
    model: nn.Module
    device: torch.device
    rank: int
    world_size: int
    local_rank: int
    grad_accum: int
    run_dir: Path


class StepGuard(Protocol):
    """What an engine asks during its step (train.max_bad_steps, train.spike_factor): the
    loop's LossGuard (launcher/rank/guard.py), or UNGUARDED."""

    scaler_owns_nonfinite: bool

    @property
    def on(self) -> bool: ...  # LossGuard's is a property

    def admit(self, loss: torch.Tensor, owner: bool, grad_norm: torch.Tensor) -> bool: ...

    def judge_loss(self, loss: torch.Tensor, owner: bool) -> tuple[str | None, float | None]: ...

    def verdict(self, why: str | None, loss: float | None = None) -> None: ...


class Unguarded:
    """The guard of an engine no loop guards (a script, a probe): every step applies."""

    on = False
    scaler_owns_nonfinite = False

    def admit(self, loss: torch.Tensor, owner: bool, grad_norm: torch.Tensor) -> bool:
        return True

    def judge_loss(self, loss: torch.Tensor, owner: bool) -> tuple[str | None, float | None]:
        return None, None

    def verdict(self, why: str | None, loss: float | None = None) -> None:
        pass


UNGUARDED = Unguarded()


class Engine(abc.ABC):
    """The contract of an engine (what `build(ctx)` of engines/<engine> returns). Each engine implements
    the abstract methods; the hooks after them have defaults most engines keep. `check`
    holds every engine of the registry to it (tests/unit/test_engines.py), and a rank
    refuses a build that is not an Engine (rank/entry.py)."""

    model: nn.Module
    """This rank's model (its shards, or a pipeline's stages under the full model's names)."""
    scheduler: torch.optim.lr_scheduler.LRScheduler
    """The learning-rate schedule (a loss-guard rollback keeps it where the steps are)."""
    guard: StepGuard = UNGUARDED
    """train.max_bad_steps: asked between clipping and the optimizer step (`guard.admit`);
    the loop sets its LossGuard here once, before the first step."""
    stages: Sequence = ()
    """A pipeline's PipelineStages on this rank, which its schedule calls instead of the
    model (train.straggler_factor times their modules); empty for the others."""

    @abc.abstractmethod
    def train_step(self, micro_batches: list[Batch]) -> StepResult:
        """One optimizer step over this rank's micro-batches (the guard asked before the update)."""

    @abc.abstractmethod
    def eval_step(self, micro_batches: list[Batch]) -> StepResult:
        """The loss alone, no update (train.eval_every; engine.evaluate for most engines)."""

    @abc.abstractmethod
    def state_bytes(self) -> MemoryBreakdown: ...

    @abc.abstractmethod
    def lr(self) -> float: ...

    @abc.abstractmethod
    def save(self, path: Path, staging=None):
        """Write this rank's part of the model and optimizer state under `path` (a folder
        every rank can see). Called on every rank. With `staging` (the Checkpointer of an
        async save, checkpoint.async_save): copy that state into host memory
        (`staging.staged`; collectives, if any, on the default group as in a plain save) and
        return a function that writes it; the checkpointer's writer thread calls it while
        training goes on (collectives there only on `staging.group`)."""

    @abc.abstractmethod
    def warm(self, staging):
        """checkpoint.async_save, at start-up: stage what save(path, staging) will stage (or
        its bulk) once, so its host buffers exist before the first save; returns the copy."""

    @abc.abstractmethod
    def load(self, path: Path) -> None: ...

    @abc.abstractmethod
    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """Full model weights (fp32, on CPU) on every rank; used for export and checks."""

    # -------------------------------------------------------------------------- hooks
    @property
    def output_module(self) -> nn.Module:
        """The module whose output is this rank's loss, or its stage's activations
        (debug.fault=nan_loss|spike|slow hook it): the model, or a pipeline's last stage."""
        return self.model

    def can_discard_step(self) -> bool:
        """After a step that ran out of memory: whether `discard_step` can drop it so that it
        runs again (train.oom_backoff in place, launcher/rank/backoff.py). False by default:
        the launcher backs off by a relaunch from the last checkpoint."""
        return False

    def discard_step(self) -> None:
        """Drop the failed step (its gradients, a wrapper left waiting) before it runs again."""
        raise NotImplementedError(f"{type(self).__name__} cannot drop a failed step")


def check(cls: type) -> list[str]:
    """What keeps `cls` from being an Engine: not a subclass, an abstract method left
    unimplemented, a method whose parameters differ from the contract's, a hook that is
    no longer a property. Empty when it conforms."""
    if not (isinstance(cls, type) and issubclass(cls, Engine)):
        return [f"{cls!r} is not a subclass of launcher.rank.engine.Engine"]
    problems = [f"{cls.__name__}.{name} is not implemented" for name in sorted(cls.__abstractmethods__)]
    for name, declared in vars(Engine).items():
        if name.startswith("_") or not callable(declared) and not isinstance(declared, property):
            continue
        actual = inspect.getattr_static(cls, name)
        if isinstance(declared, property) != isinstance(actual, property):
            problems.append(f"{cls.__name__}.{name}: a property in the contract, not here, or the reverse")
        elif not isinstance(declared, property) and _parameters(actual) != _parameters(declared):
            problems.append(
                f"{cls.__name__}.{name}{inspect.signature(actual)}: the contract says "
                f"{name}{inspect.signature(declared)}"
            )
    return problems


def _parameters(fn) -> list[tuple[str, object, bool]]:
    return [(p.name, p.kind, p.default is p.empty) for p in inspect.signature(fn).parameters.values()]


# ----------------------------------------------------------------------------- helpers
def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (weights, embeddings); not vectors (norms, biases)."""
    decay: list = []
    no_decay: list = []
    seen = set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        # A ZeRO-3 partitioned parameter's tensor is a flat placeholder: its shape is ds_shape.
        (decay if len(getattr(p, "ds_shape", p.shape)) >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [
        g for g in groups if g["params"]
    ]  # model.lora's adapters are all matrices: no empty group (DCP trips on one)


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    """optim.name's optimizer (launcher/optim/) over param_groups(model)."""
    return optim.build(param_groups(model, cfg.weight_decay), model, cfg, device)


class Schedule(torch.optim.lr_scheduler.LambdaLR):
    """LambdaLR whose learning rates read back as floats: torchao's optimizers keep each
    group's lr as a tensor (the schedule fills it in place); metrics want a number."""

    def get_last_lr(self) -> list[float]:
        return [float(lr) for lr in super().get_last_lr()]


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Config) -> torch.optim.lr_scheduler.LambdaLR:
    return Schedule(optimizer, lambda s: lr_factor(s, cfg.train.steps, cfg.optim))


def set_lrs(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """The schedule's current learning rates into the optimizer's groups (after a load
    brought other ones back), in place where a group keeps its lr as a tensor (torchao)."""
    for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def evaluate(
    model: nn.Module,
    micro_batches: list[Batch],
    device: torch.device,
    dtype: torch.dtype | None,
    loss_owner: bool = True,
) -> StepResult:
    """train.eval_every: the mean loss over `micro_batches`, forward only (no gradients, the
    model in eval mode), in the training's autocast; an engine's eval_step for a model that
    takes (inputs, targets[, positions]) and returns the loss. Sharded and replicated models alike:
    every rank runs it, as the forward's collectives need."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast(device, dtype):
            total = torch.zeros((), device=device)
            for batch in micro_batches:
                total += model(*batch).detach().float()
    finally:
        model.train(was)
    return StepResult(loss=total / len(micro_batches), grad_norm=torch.zeros((), device=device), loss_owner=loss_owner)


def owners_sum(loss: torch.Tensor, owner: bool, device: torch.device) -> torch.Tensor:
    """The sum over ranks of the owners' losses (one rank per data-parallel slice owns its
    slice's loss; each of a cp group its positions' mean: equal counts, so their mean is
    the slice's); the caller divides by the slices. A collective: every rank calls it."""
    total = loss.detach().clone() if owner else torch.zeros((), device=device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total


def parameter_leaves(root: nn.Module) -> list[nn.Module]:
    """The modules under `root` with no children that hold parameters of their own: the
    linears, embeddings and norms, where a forward's FLOPs are."""
    return [
        m
        for m in root.modules()
        if next(m.children(), None) is None and next(m.parameters(recurse=False), None) is not None
    ]


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard, a plain tensor itself."""
    return t._local_tensor if is_dtensor(t) else t


def tensor_bytes(tensors) -> int:
    """Bytes these tensors occupy on this rank (a DTensor: its local shard only; a tensor
    subclass such as torchao's quantized optimizer states: the tensors it holds, its codes
    and scales, not the dtype it shows)."""
    return sum(held_bytes(t) for t in tensors if t is not None)


def held_bytes(t: torch.Tensor) -> int:
    t = local_shard(t)
    if type(t) in (torch.Tensor, nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return t.numel() * t.element_size()
    inner, _ = t.__tensor_flatten__()
    return sum(held_bytes(getattr(t, name)) for name in inner)


def trained_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint holds of the model: its state dict, or with frozen parameters
    (model.lora) only what trains (the base is read from model.pretrained again on resume:
    megabytes instead of the model's gigabytes)."""
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    state = model.state_dict()
    return {k: v for k, v in state.items() if k not in frozen} if frozen else state


def load_trained(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """The inverse of trained_state: every trained tensor must be there, frozen ones may not."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    if unexpected or set(missing) - frozen:
        raise RuntimeError(
            f"checkpoint does not match the model: missing {sorted(set(missing) - frozen)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}"
        )


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(tensor_bytes(v for v in state.values() if torch.is_tensor(v)) for state in optimizer.state.values())

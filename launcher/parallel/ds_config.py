"""DeepSpeed's JSON config, generated from the one Hydra config.

    deepspeed_config(cfg, world_size, cuda) -> dict    pure: every key from train.*, optim.*,
                                                       precision.*, recipe.zero.*
    merge_extra(generated, extra) -> dict              pure: recipe.zero.extra on top; a key the
                                                       Hydra config already sets must agree
    check(merged, extra, world_size)                   DeepSpeed's own config parser, no ranks;
                                                       a key of extra it never reads is unknown
    launch_config(cfg, world_size, cuda) -> dict       all three: what the launch side writes
                                                       to RUN_DIR/ds_config.json

The launch side writes the file once per launch; ranks read it (`read`) and never build
their own. Every conflict is a `ConfigError`: one line, exit code 2, before any rank starts.

Two things are deliberately *not* in the JSON:
- the learning-rate schedule: the engine hands DeepSpeed the project's own schedule
  (launcher.config.lr_factor through LambdaLR), so ddp and zero follow the same curve step
  for step. DeepSpeed's WarmupCosineLR would run the first two steps at lr 0 and its warm-up
  would never reach the peak (it uses (s-1)/W where lr_factor uses (s+1)/W); a `scheduler`
  key in recipe.zero.extra is refused.
- `checkpoint.load_universal`: the engine switches it on for the one load that resumes a
  checkpoint written at another world size (engines/zero/engine.py), and only then.
"""

from __future__ import annotations

import collections.abc
import contextlib
import copy
import dataclasses
import inspect
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from launcher import config as C
from launcher.models import model_shape
from launcher.parallel import degrees as D

FILE = "ds_config.json"

# The Hydra key that owns each generated DeepSpeed key (dotted paths; the longest prefix wins).
OWNERS = {
    "train_batch_size": "train.global_batch",
    "train_micro_batch_size_per_gpu": "train.micro_batch",
    "gradient_accumulation_steps": "train.grad_accum",
    "gradient_clipping": "optim.grad_clip",
    "optimizer": "optim",
    "bf16": "precision",
    "fp16": "precision",
    "scheduler": "optim (warmup_steps, min_lr_ratio: the schedule is launcher.config.lr_factor)",
    "activation_checkpointing": "train.activation_checkpointing",
    "zero_optimization.stage3_prefetch_bucket_size": "recipe.zero.prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold": "recipe.zero.param_persistence_threshold",
    "zero_optimization.stage3_max_live_parameters": "recipe.zero.max_live_parameters",
    "zero_optimization.stage3_max_reuse_distance": "recipe.zero.max_reuse_distance",
    "zero_optimization.offload_optimizer": "recipe.zero.offload_optimizer",
    "zero_optimization.offload_param": "recipe.zero.offload_param",
    "steps_per_print": "logger.log_every (the launcher logs; DeepSpeed stays quiet)",
}
# Keys the Hydra config owns even where the generated JSON leaves them out.
OWNED_ABSENT = ("scheduler",)
PASSED_ON = "optimizer.params."  # DeepSpeed hands these to the optimizer unread
QUIET = 2**31 - 1  # steps_per_print: DeepSpeed's own progress lines would repeat the launcher's


# ----------------------------------------------------------------------------- generate
GLOO_BUCKET_CAP = 50_000_000
"""The most elements a gloo run's default reduce bucket holds (200 MB in fp32): see for_backend."""


def reduce_bucket(cfg: C.Config) -> int:
    """reduce_bucket_size: recipe.zero's (the launch side resolves a null one for the ranks'
    backend: for_backend), or model.dim^2, the NCCL default `make plan` prices for GPUs."""
    return cfg.recipe.zero.reduce_bucket_size or model_shape(cfg).dim ** 2


def multi_rank_bucket_allreduce(cfg: C.Config) -> bool:
    """zero_optimization.use_multi_rank_bucket_allreduce (recipe.zero.extra; DeepSpeed's
    default on): stage 1/2 reduce each gradient bucket with one all-reduce."""
    section = cfg.recipe.zero.extra.get("zero_optimization", {})
    return bool(section.get("use_multi_rank_bucket_allreduce", True))


def on_gloo(cfg: C.Config, cuda: bool) -> bool:
    """Whether the ranks' collectives run on gloo: dist.backend=gloo, or auto without CUDA."""
    return cfg.dist.backend == C.Backend.gloo or (cfg.dist.backend == C.Backend.auto and not cuda)


def for_backend(cfg: C.Config, gloo: bool) -> C.Config:
    """`cfg` with a null recipe.zero.reduce_bucket_size resolved for the ranks' backend, as
    the launch side writes it into config.yaml (and make plan prices it), measured in
    bench/deepspeed_defaults.md:
    - NCCL: model.dim^2 elements (Hugging Face's "auto"): 16.7M-268M at dim 4096-16384,
      33-537 MB in bf16, already past the bandwidth knee, where DeepSpeed's own 5e8 would
      hold 1 GB (2 GB under overlap_comm) on the GPU for the whole run at stage 3.
    - gloo: every trainable element in one bucket, at most GLOO_BUCKET_CAP. gloo pays about
      2 ms a message: buckets of dim^2 (80 a step for a 5.3M model) cost it 13% of the step
      (the recipe 0.86x of a loop on DeepSpeed's 5e8, 0.97x given one bucket). Above the cap
      an extra message is milliseconds of a step of seconds, while the bucket is host memory
      each rank holds (DeepSpeed allocates it whole: 2 GB in fp32 at 5e8)."""
    z = cfg.recipe.zero
    if z.reduce_bucket_size is not None:
        return cfg
    size = min(trainable_elements(cfg), GLOO_BUCKET_CAP) if gloo else reduce_bucket(cfg)
    zero = dataclasses.replace(z, reduce_bucket_size=size)
    return dataclasses.replace(cfg, recipe=dataclasses.replace(cfg.recipe, zero=zero))


def trainable_elements(cfg: C.Config) -> int:
    """The elements DeepSpeed reduces each step: every parameter, or model.lora's adapters."""
    m = dataclasses.replace(model_shape(cfg), lora=cfg.model.lora)  # model=hf: its shape
    if m.lora.rank > 0:
        from launcher.planner import lora  # local: torch (the planner's adapter count)

        return lora.counts(m).trainable
    return C.num_params(m)


def prefetch_bucket(cfg: C.Config) -> int:
    """stage3_prefetch_bucket_size: recipe.zero's, or one decoder block's matmul weights, so
    that the next block is gathered whole while this one computes (the planner's gathered
    layers: this one and the next). Hugging Face's "auto", 0.9 x dim^2, is a twelfth of a
    Llama block: the rest of it was gathered on demand, exposed."""
    return cfg.recipe.zero.prefetch_bucket_size or C.block_matmul_params(model_shape(cfg))


def overlap_comm(cfg: C.Config) -> bool:
    """overlap_comm: recipe.zero's, or DeepSpeed's own default (on for stage 3 only)."""
    z = cfg.recipe.zero
    return z.overlap_comm if z.overlap_comm is not None else z.stage == 3


def persistence_threshold(cfg: C.Config) -> int:
    """stage3_param_persistence_threshold: recipe.zero's, or 10 x model.dim (the norms)."""
    z = cfg.recipe.zero
    return z.param_persistence_threshold if z.param_persistence_threshold is not None else 10 * model_shape(cfg).dim


def deepspeed_config(cfg: C.Config, world_size: int, cuda: bool) -> dict[str, Any]:
    """The DeepSpeed config of `cfg` at `world_size` ranks (pure)."""
    t, o, p = cfg.train, cfg.optim, cfg.precision
    accum = D.grad_accum(cfg, world_size)
    m = model_shape(cfg)  # model=hf: the sizes from its Hugging Face config
    out: dict[str, Any] = {
        "train_batch_size": t.micro_batch * accum * world_size,
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": o.grad_clip,
        "steps_per_print": QUIET,
        "optimizer": {"type": "AdamW", "params": optimizer_params(cfg, cuda)},
        # Both flags always written, so an extra key cannot switch precision behind precision=.
        "bf16": {"enabled": p.name == C.Precision.bf16},
        "fp16": {"enabled": p.name == C.Precision.fp16},
        "zero_optimization": zero_section(cfg, m.dim * m.dim),
    }
    if p.name == C.Precision.fp16:
        out["fp16"].update(
            {
                "loss_scale": 0,  # dynamic
                "initial_scale_power": int(math.log2(p.initial_scale)),
                "loss_scale_window": p.growth_interval,
                "min_loss_scale": p.min_scale,
                "hysteresis": 1,  # halve on the first overflow, as torch's GradScaler does
            }
        )
    if t.activation_checkpointing != C.ACMode.none:
        # The model recomputes blocks with torch.utils.checkpoint (launcher/models/gpt.py);
        # DeepSpeed's own activation partitioning and CPU checkpointing act only on its
        # checkpoint function, which the model does not use: recorded here as off.
        blocks = (
            m.n_layers
            if t.activation_checkpointing in (C.ACMode.full, C.ACMode.op)
            else len(range(0, m.n_layers, t.ac_every))
        )
        out["activation_checkpointing"] = {
            "partition_activations": False,
            "cpu_checkpointing": False,
            "contiguous_memory_optimization": False,
            "number_checkpoints": blocks,
            "synchronize_checkpoint_boundary": False,
            "profile": False,
        }
    return out


def zero_section(cfg: C.Config, dim2: int) -> dict[str, Any]:
    """zero_optimization: the stage, its buckets (dim2: the default all-gather bucket, dim²),
    stage 3's prefetch and persistence, offload written whichever way it is set."""
    z = cfg.recipe.zero
    zero: dict[str, Any] = {
        "stage": z.stage,
        # DeepSpeed's own default, made explicit so ds_config.json says what runs.
        "overlap_comm": overlap_comm(cfg),
        "contiguous_gradients": z.contiguous_gradients,
        "reduce_scatter": z.reduce_scatter,
        "reduce_bucket_size": reduce_bucket(cfg),
        "allgather_bucket_size": z.allgather_bucket_size or dim2,
    }
    if z.stage == 3:
        zero.update(
            {
                "stage3_prefetch_bucket_size": prefetch_bucket(cfg),
                "stage3_param_persistence_threshold": persistence_threshold(cfg),
                "stage3_max_live_parameters": z.max_live_parameters,
                "stage3_max_reuse_distance": z.max_reuse_distance,
            }
        )
    # Written even when off ("none"), so an extra key cannot switch offload on behind the recipe.
    for key in ("offload_optimizer", "offload_param"):
        device = getattr(z, key)
        zero[key] = {"device": device.value}
        if device != C.OffloadDevice.none:
            zero[key]["pin_memory"] = z.pin_memory
    return zero


def optimizer_params(cfg: C.Config, cuda: bool) -> dict[str, Any]:
    """The AdamW optimizer's params: torch's AdamW on the device (fused on CUDA unless
    optim.fused says), DeepSpeedCPUAdam when the optimizer is offloaded."""
    o, z = cfg.optim, cfg.recipe.zero
    params: dict[str, Any] = {"lr": o.lr, "betas": [o.beta1, o.beta2], "eps": o.eps, "weight_decay": o.weight_decay}
    if z.offload_optimizer == C.OffloadDevice.none:
        # torch.optim.AdamW, as ddp uses (DeepSpeed's FusedAdam would be JIT-compiled for CUDA).
        params["torch_adam"] = True
        fused = o.fused if o.fused is not None else cuda
        if fused:
            params["fused"] = True
    # else: DeepSpeedCPUAdam, in AdamW mode (decoupled decay) because the type is AdamW.
    return params


# ----------------------------------------------------------------------------- merge
def _owner(path: str) -> str:
    parts = path.split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in OWNERS:
            return OWNERS[key]
    if parts[0] == "zero_optimization" and len(parts) > 1:
        return f"recipe.zero.{parts[1]}"
    return "the Hydra config"


def merge_extra(generated: dict, extra: dict, prefix: str = "") -> dict:
    """`generated` with `extra` merged in (pure). A leaf both set must have the same value."""
    out = copy.deepcopy(generated)
    for key, value in extra.items():
        path = f"{prefix}{key}"
        if not prefix and key in OWNED_ABSENT:
            raise C.ConfigError(
                f"recipe.zero.extra.{path}", _show(value), f"set by the Hydra config, not here: {_owner(path)}"
            )
        if key not in out:
            out[key] = copy.deepcopy(value)
        elif isinstance(out[key], dict) and isinstance(value, dict):
            out[key] = merge_extra(out[key], value, f"{path}.")
        elif out[key] != value:
            raise C.ConfigError(
                f"recipe.zero.extra.{path}",
                _show(value),
                f"contradicts the Hydra config, which sets {_show(out[key])} from {_owner(path)}: change it there",
            )
    return out


def _show(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


# ----------------------------------------------------------------------------- check
class _Seen(dict):
    """A dict that records what DeepSpeed's parser reads: single keys (`seen`) and whole
    sections it iterates (`whole`: handed to a pydantic model, which refuses unknown keys
    itself). `__iter__` is overridden so that `**section` goes through keys()/__getitem__."""

    def __init__(self, data: dict, seen: set, whole: set, prefix: str = ""):
        super().__init__(
            {k: _Seen(v, seen, whole, f"{prefix}{k}.") if isinstance(v, dict) else v for k, v in data.items()}
        )
        self._seen, self._whole, self._prefix = seen, whole, prefix

    def _mark(self, key) -> None:
        self._seen.add(f"{self._prefix}{key}")

    def _mark_all(self) -> None:
        self._whole.add(self._prefix)
        for key in super().keys():
            self._mark(key)

    def __getitem__(self, key):
        self._mark(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._mark(key)
        return super().get(key, default)

    def __contains__(self, key):
        self._mark(key)
        return super().__contains__(key)

    def pop(self, key, *default):
        self._mark(key)
        return super().pop(key, *default)

    def __iter__(self):
        self._mark_all()
        return super().__iter__()

    def keys(self):
        return _SeenKeys(self)

    def items(self):
        self._mark_all()
        return super().items()

    def __copy__(self):
        new = _Seen({}, self._seen, self._whole, self._prefix)
        dict.update(new, {k: dict.__getitem__(self, k) for k in dict.keys(self)})
        return new


class _SeenKeys(collections.abc.KeysView):
    """`key in d.keys()` (DeepSpeed's usual test) reads one key; iterating reads them all."""

    def __contains__(self, key):
        return key in self._mapping

    def __iter__(self):
        self._mapping._mark_all()
        return dict.__iter__(self._mapping)


def _leaves(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        out += _leaves(v, f"{prefix}{k}.") if isinstance(v, dict) and v else [f"{prefix}{k}"]
    return out


@contextlib.contextmanager
def _quiet_deepspeed():
    """DeepSpeed logs its parse at INFO; the launch side prints only its own lines."""
    logger = logging.getLogger("DeepSpeed")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def check(merged: dict, extra: dict, world_size: int) -> None:
    """Parse `merged` with DeepSpeed's DeepSpeedConfig as `world_size` ranks would, without
    starting any. Refuses what the parser refuses, and any key of recipe.zero.extra that it
    never reads (a key DeepSpeed does not know)."""
    from deepspeed.runtime.config import DeepSpeedConfig  # local: torch (launch side)
    from pydantic import ValidationError  # local: start-up (pydantic, 0.4 s, launch side)

    class Planned(DeepSpeedConfig):
        # Outside a process group DeepSpeed assumes one rank; the batch check needs the real count.
        def _configure_train_batch_size(self):
            self.world_size = world_size
            super()._configure_train_batch_size()

    seen: set[str] = set()
    whole: set[str] = set()
    try:
        with _quiet_deepspeed():
            Planned(_Seen(merged, seen, whole))
    except ValidationError as e:
        err = e.errors()[0]
        section = _section_of(e.title, extra)
        where = ".".join(str(x) for x in err.get("loc", ()))
        path = f"{section}.{where}" if where else section
        try:
            value = _get(extra, path.split("."))
        except (KeyError, TypeError):
            value = err.get("input")
        raise C.ConfigError(
            f"recipe.zero.extra.{path}", _show(value), f"DeepSpeed refuses it: {err.get('msg')}"
        ) from None
    except Exception as e:  # DeepSpeed's parser asserts and raises plain errors
        text = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
        raise C.ConfigError("recipe.zero.extra", _show(extra), f"DeepSpeed refuses the merged config: {text}") from None
    for leaf in _leaves(extra):
        if leaf.startswith(PASSED_ON):
            continue  # handed to the optimizer's constructor: _check_optimizer_params
        parts = leaf.split(".")
        handed_over = any(".".join(parts[:n]) + "." in whole for n in range(1, len(parts)))
        if leaf not in seen and not handed_over:
            raise C.ConfigError(
                f"recipe.zero.extra.{leaf}",
                _show(_get(extra, parts)),
                "DeepSpeed does not know this key (its config parser never reads it)",
            )
    _check_optimizer_params(merged, extra)


def _get(d: dict, parts: list[str]):
    for p in parts:
        d = d[p]
    return d


def _section_of(model_title: str, extra: dict) -> str:
    """The section a pydantic error came from (pydantic names the model, not the key)."""
    sections = {
        "DeepSpeedZeroConfig": "zero_optimization",
        "DeepSpeedZeroOffloadOptimizerConfig": "zero_optimization.offload_optimizer",
        "DeepSpeedZeroOffloadParamConfig": "zero_optimization.offload_param",
        "DeepSpeedBF16Config": "bf16",
        "DeepSpeedFP16Config": "fp16",
    }
    return sections.get(model_title, next(iter(extra), "?"))


def _check_optimizer_params(merged: dict, extra: dict) -> None:
    """DeepSpeed passes optimizer.params on to the optimizer's constructor unread: a key
    that constructor does not take would only fail on the ranks, so check it here."""
    added = set(extra.get("optimizer", {}).get("params", {}))
    if not added:
        return
    params = merged["optimizer"]["params"]
    if params.get("torch_adam"):
        import torch  # local: torch (launch side)

        takes = set(inspect.signature(torch.optim.AdamW).parameters) | {"torch_adam"}
    else:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # local: torch (launch side)

        takes = set(inspect.signature(DeepSpeedCPUAdam).parameters) | {"fp32_optimizer_states", "adam_w_mode"}
    for key in sorted(added - takes):
        raise C.ConfigError(
            f"recipe.zero.extra.optimizer.params.{key}",
            _show(extra["optimizer"]["params"][key]),
            f"the optimizer does not take it; allowed: {', '.join(sorted(takes - {'params'}))}",
        )


# ----------------------------------------------------------------------------- launch / ranks
def launch_config(cfg: C.Config, world_size: int, cuda: bool) -> dict:
    """Generate, merge recipe.zero.extra, check with DeepSpeed's parser: the launch side's call."""
    merged = merge_extra(deepspeed_config(cfg, world_size, cuda), cfg.recipe.zero.extra)
    check(merged, cfg.recipe.zero.extra, world_size)
    return merged


def text(config: dict) -> str:
    return json.dumps(config, indent=1, sort_keys=True) + "\n"


def read(run_dir: Path, world_size: int) -> dict:
    """The rank side: RUN_DIR/ds_config.json as the launch side wrote it, for this world size."""
    path = run_dir / FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: start ZeRO runs with `launcher train` (it writes the file), "
            f"or write it with launcher.parallel.ds_config.launch_config"
        )
    config = json.loads(path.read_text())
    micro, accum = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
    if config["train_batch_size"] != micro * accum * world_size:
        raise RuntimeError(
            f"{path} was written for another world size: train_batch_size "
            f"{config['train_batch_size']} != {micro} x {accum} x {world_size} ranks"
        )
    return config


def rebatch(run_dir: Path, micro_batch: int, grad_accum: int) -> None:
    """train.oom_backoff: RUN_DIR/ds_config.json with a smaller micro-batch and the larger
    accumulation that keeps train_batch_size (written whole, as config.yaml is)."""
    path = run_dir / FILE
    config = json.loads(path.read_text())
    if micro_batch * grad_accum != config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"]:
        raise ValueError(
            f"{path}: {micro_batch} x {grad_accum} would change the batch of "
            f"{config['train_micro_batch_size_per_gpu']} x {config['gradient_accumulation_steps']}"
        )
    config.update(train_micro_batch_size_per_gpu=micro_batch, gradient_accumulation_steps=grad_accum)
    tmp = path.with_name(FILE + ".tmp")
    tmp.write_text(text(config))
    os.replace(tmp, path)

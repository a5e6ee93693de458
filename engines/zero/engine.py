"""The ZeRO engine (the recipes' spec and design: engines/zero/__init__.py): DeepSpeed
built from RUN_DIR/ds_config.json with the project's parameter groups and schedule, the
memory count from DeepSpeed's own buffers, checkpoints loaded with weights_only=True (and
through the universal checkpoint at another world size), and `consolidate()` for export."""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import shutil
import warnings
from pathlib import Path

import cpuinfo
import torch
import torch.distributed as dist

from engines.zero import import_deepspeed
from launcher import models
from launcher.manifest import root_of
from launcher.parallel import ds_config
from launcher.planner.zero import zero_states
from launcher.rank.async_save import StagedFiles
from launcher.rank.engine import (
    BuildContext,
    Engine,
    MemoryBreakdown,
    StepResult,
    build_scheduler,
    evaluate,
    param_groups,
)
from launcher.untrusted import weights_only_loads

# DeepSpeed 0.19 calls torch collectives torch 2.13 deprecates; one warning per rank per call
# site, on every launch. Nothing the user can act on.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)

TAG = "ds"  # DeepSpeed's checkpoint tag: files go to engine/ds/
META = "zero.json"  # world size and stage of a checkpoint, read before DeepSpeed loads it
UNIVERSAL_INFO = {"universal_checkpoint_info": {"universal_checkpoint_version": 0.2}}


# ----------------------------------------------------------------------------- engine
def restore_linear() -> None:
    """zero.Init replaces torch.nn.functional.linear with DeepSpeed's own for the rest of the
    process ("This will persist unless manually reset"); it changes what autograd saves.
    A rank runs one engine; a process that builds several (scripts/measure_memory.py, a
    rehearsal) gives later engines torch's own back."""
    # local: order (DS_ACCELERATOR first: engines.zero.import_deepspeed)
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as patcher

    if hasattr(patcher, "linear_bk"):
        torch.nn.functional.linear = patcher.linear_bk


def cpu_info_once() -> None:
    """DeepSpeedCPUAdam asks py-cpuinfo for the CPU's vendor each time one is built, and
    each call runs a Python subprocess (1.2 s here). The answer cannot change within a
    process: cached, so engines built after the first (scripts/measure_memory.py builds
    dozens per process) do not pay it again."""
    if not hasattr(cpuinfo.get_cpu_info, "cache_info"):
        cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)


class ZeroEngine(Engine):
    def __init__(self, ctx: BuildContext):
        deepspeed = import_deepspeed()
        cpu_info_once()
        cfg = ctx.cfg
        self.cfg, self.device, self.rank, self.world_size = cfg, ctx.device, ctx.rank, ctx.world_size
        self.config = ds_config.read(ctx.run_dir, ctx.world_size)
        self.scratch = root_of(cfg, ctx.run_dir)  # resharding's scratch: this run's own checkpoint folder
        self.stage = self.config["zero_optimization"]["stage"]
        # deepspeed.comm joins the process group rank/entry.py made (zero.Init reads the world from
        # it). On a CPU it builds a shared-memory op and prints so on stdout, once per rank.
        with contextlib.redirect_stdout(io.StringIO()):
            deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
        low = (
            torch.bfloat16
            if self.config["bf16"]["enabled"]
            else torch.float16
            if self.config["fp16"]["enabled"]
            else None
        )
        if self.stage == 3:  # partitioned as it is built: no rank ever holds the whole model
            with deepspeed.zero.Init(config_dict_or_path=self.config):  # made in the dtype it keeps
                model = models.prepare(models.skeleton(cfg, ctx.device, low), cfg)
            models.materialize(model, cfg, ctx.device)
        else:  # stages 0-2 replicate the weights by design: built once, directly on the device,
            # in the dtype DeepSpeed keeps them in (it would cast an fp32 model: twice the bytes at start-up)
            model = models.materialize(models.cast_params(ctx.model, low) if low else ctx.model, cfg, ctx.device)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model,
            model_parameters=param_groups(model, cfg.optim.weight_decay),
            config=self.config,
            # The project's schedule on DeepSpeed's inner optimizer (see launcher/parallel/ds_config.py).
            lr_scheduler=lambda optimizer: build_scheduler(optimizer, cfg),
        )
        self.model = self.engine.module
        self.accum = self.config["gradient_accumulation_steps"]
        self.memory = ZeroMemory(self.optimizer, self.model, ctx.device)
        self.strict = all(p.requires_grad for p in self.model.parameters())  # model.lora: the base is not saved
        self.steps = 0
        self.memory.sample()  # before the first step: what the engine holds at rest

    def train_step(self, micro_batches) -> StepResult:
        assert len(micro_batches) == self.accum, (len(micro_batches), self.accum)
        self.steps += 1
        # Count the memory on the first two steps (Adam's moments appear in the first) and on
        # the steps the loop logs; the count costs about 0.1-0.3 ms a sample.
        self.memory.start_step(active=self.steps <= 2 or self.steps % self.cfg.logger.log_every == 0)
        total = torch.zeros((), device=self.device)
        own_norm = None
        why = value = None
        for i, batch in enumerate(micro_batches):  # (inputs, targets[, positions]): DeepSpeed passes them on
            loss = self.engine(*batch)
            total += loss.detach().float()
            if i == len(micro_batches) - 1:  # train.spike_factor: judged before the last backward
                why, value = self.guard.judge_loss(total / len(micro_batches), True)
                if why is not None:  # DeepSpeed skips a step whose gradients are not finite (ZeRO 1-3)
                    loss = loss * float("nan")
            # DeepSpeed divides by the accumulation steps and reduces gradients in buckets;
            # step() is a no-op except at the accumulation boundary.
            self.engine.backward(loss)
            self.memory.sample()
            if self.stage == 0 and self.engine.is_gradient_accumulation_boundary():
                own_norm = self._reduced_grad_norm()
            self.engine.step()
        if self.guard.on:
            self._guarded(why, value)
        norm = self.engine.get_global_grad_norm()
        norm = own_norm if norm is None else norm  # stage 0 in fp32 does not keep it
        # A tensor stays a tensor (no host read each step: the loop reads it when it logs).
        grad_norm = norm.detach() if torch.is_tensor(norm) else torch.tensor(float("nan") if norm is None else norm)
        scale = skipped = None
        if self.config["fp16"]["enabled"]:
            scale = float(self.optimizer.loss_scale)  # fp16 (CUDA only): the dynamic loss scale after this step
            skipped = not self.engine.was_step_applied()
        return StepResult(loss=total / len(micro_batches), grad_norm=grad_norm, skipped=bool(skipped), loss_scale=scale)

    def _guarded(self, why: str | None, loss: float | None) -> None:
        """train.max_bad_steps: what DeepSpeed did with the step, to the guard. A step it
        skipped for non-finite gradients is bad (under fp16 that is the loss scaler's); a
        skip leaves DeepSpeed's schedule behind, so it is stepped here (the schedule follows
        the step number, as in the other engines)."""
        applied = self.engine.was_step_applied()
        if why is None and not applied and not self.guard.scaler_owns_nonfinite:
            why = "gradient norm not finite (DeepSpeed skipped the step)"
        if not applied and why is not None:
            self.scheduler.step()
        self.guard.verdict(why, loss if why is None else None)

    def _reduced_grad_norm(self) -> torch.Tensor:
        """Stage 0: the gradients are whole and already averaged after the last backward."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))

    def eval_step(self, micro_batches) -> StepResult:
        # DeepSpeed's engine casts and gathers (ZeRO-3) as in training; no autocast around it
        return evaluate(self.engine, micro_batches, self.device, None)

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def state_bytes(self) -> MemoryBreakdown:
        return self.memory.breakdown()

    # -------------------------------------------------------------------------- state
    def save(self, path: Path, staging=None):
        """Every rank writes its shards under path/ds/ (DeepSpeed's layout); rank 0 adds
        zero.json. No `latest` file: the Checkpointer owns that. With `staging` (an async
        save): DeepSpeed's save runs as ever (its collectives, its folders), but each file it
        would write is copied into host memory instead; the returned function writes them."""
        path.mkdir(parents=True, exist_ok=True)
        own = self.engine.checkpoint_engine
        held = StagedFiles(own, staging) if staging is not None else None
        self.engine.checkpoint_engine = held or own
        try:
            self.engine.save_checkpoint(
                str(path), tag=TAG, client_state=dict(UNIVERSAL_INFO), save_latest=False, exclude_frozen_parameters=True
            )  # model.lora: the base is model.pretrained
        finally:
            self.engine.checkpoint_engine = own
        if self.rank == 0:
            (path / META).write_text(
                json.dumps({"world_size": self.world_size, "stage": self.stage, "tag": TAG}) + "\n"
            )
        return held.write if held is not None else None

    def warm(self, staging):
        """checkpoint.async_save: the optimizer's state (DeepSpeed's partitions, the Adam
        states: the bulk of every rank's files) staged once at start-up, so that the first
        save reuses the buffers as every later one does. The model file DeepSpeed clones
        anew at each save."""
        return staging.staged(self.optimizer.state_dict())

    def load(self, path: Path) -> None:
        saved = json.loads((path / META).read_text())
        if saved["world_size"] == self.world_size or saved["stage"] == 0:  # stage 0 shards nothing
            with weights_only_loads():
                loaded, _ = self.engine.load_checkpoint(str(path), tag=TAG, load_module_strict=self.strict)
        else:
            loaded = self._load_resharded(path, saved["world_size"])
        if loaded is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint in {path}")
        dist.barrier()

    def _load_resharded(self, path: Path, saved_world: int):
        """A checkpoint of another world size: rank 0 converts it to DeepSpeed's universal
        format (one file per parameter and state, unsharded) in this run's own checkpoint
        folder (locked by this run, its room checked at launch), in a `.tmp` folder the next
        save cleans up; every rank loads its new shard from there. The source is only read:
        another run's checkpoint, a read-only one, one that other runs resume from too."""
        scratch = self.scratch / f"{path.parent.name}.universal.tmp"
        if self.rank == 0:
            shutil.rmtree(scratch, ignore_errors=True)
            scratch.mkdir(parents=True)
            to_universal(path / TAG, scratch / TAG)
            print(
                f"resharding a checkpoint of {saved_world} rank(s) onto {self.world_size} "
                f"(DeepSpeed universal checkpoint in {scratch})",
                flush=True,
            )
        dist.barrier()
        self.engine._config.load_universal_checkpoint = True  # for this one load only
        try:
            with weights_only_loads():
                loaded, _ = self.engine.load_checkpoint(str(scratch), tag=TAG, load_module_strict=self.strict)
        finally:
            self.engine._config.load_universal_checkpoint = False
        dist.barrier()
        if self.rank == 0:
            shutil.rmtree(scratch, ignore_errors=True)
        return loaded

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 master weights on every rank (a collective under stage 3)."""
        # local: order (DS_ACCELERATOR first: engines.zero.import_deepspeed)
        from deepspeed.utils import safe_get_full_fp32_param

        return {
            name: safe_get_full_fp32_param(p).detach().float().cpu()
            for name, p in self.model.named_parameters(remove_duplicate=False)
        }


def to_universal(checkpoint: Path, out: Path) -> None:
    """DeepSpeed's ds_to_universal, in this process (serial, its output kept quiet)."""
    import_deepspeed()
    # local: order (DS_ACCELERATOR first: engines.zero.import_deepspeed)
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(
        input_folder=str(checkpoint),
        output_folder=str(out),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=False,
    )
    log = io.StringIO()
    with weights_only_loads(), contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        ds_to_universal.main(args)


def build(ctx: BuildContext) -> ZeroEngine:
    return ZeroEngine(ctx)


def consolidate(cfg, engine_dir: Path) -> dict[str, torch.Tensor]:
    """Full fp32 weights from the shards of every rank (DeepSpeed's zero_to_fp32), on one
    process without a process group. Stage 0 shards nothing: its model file holds the whole
    module (in bf16 runs, the bf16 weights)."""
    import_deepspeed()
    if json.loads((engine_dir / META).read_text())["stage"] == 0:
        with weights_only_loads():
            state = torch.load(engine_dir / TAG / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True)
        return {k: v.float() for k, v in state["module"].items()}
    # local: order (DS_ACCELERATOR first: engines.zero.import_deepspeed)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    log = io.StringIO()
    with weights_only_loads(), contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        state = get_fp32_state_dict_from_zero_checkpoint(str(engine_dir), tag=TAG)
    return {k: v.float() for k, v in state.items()}


# ----------------------------------------------------------------------------- memory
def model_state_bytes(
    stage: int,
    psi: float,
    world: int,
    grad_accum: int = 1,
    offload_optimizer: bool = False,
    offload_param: bool = False,
    largest_param: int = 0,
    bucket: int = 0,
) -> dict[str, float]:
    """{"device": bytes, "cpu": bytes} per rank: launcher.planner.zero.zero_states, summed
    (`bucket`: reduce_bucket_size, the elements of the reduce bucket it counts)."""
    parts = zero_states(stage, psi, world, grad_accum, offload_optimizer, offload_param, largest_param, bucket=bucket)
    return {"device": sum(d for d, _ in parts.values()), "cpu": sum(h for _, h in parts.values())}


class ZeroMemory:
    """What this rank holds for the model state, counted from DeepSpeed's own tensors.

    Gradients exist only inside a step (DeepSpeed frees them after the update), so the
    count is taken at several points of each step -- after every backward, and just before
    and after the inner optimizer updates each parameter group, while the fp32 gradient
    shard exists (after, too: Adam creates its moments lazily in the first update) -- and
    the point with the most bytes is reported. Each storage is counted once, under the
    first part that names it (params, then optim, then grads).
    """

    def __init__(self, optimizer, model, device: torch.device):
        self.optimizer, self.model, self.device = optimizer, model, device
        self.last: MemoryBreakdown | None = None
        self.current: MemoryBreakdown | None = None
        self.active = True
        inner = getattr(optimizer, "optimizer", optimizer)  # stage 0 in fp32: the optimizer itself
        if isinstance(inner, torch.optim.Optimizer):
            inner.register_step_pre_hook(lambda *_: self.sample())
            inner.register_step_post_hook(lambda *_: self.sample())

    def start_step(self, active: bool = True) -> None:
        self.current, self.active = None, active

    def sample(self) -> None:
        if not self.active:
            return
        now = count(terms_held(self.optimizer, self.model), self.device)
        if self.current is None or now.total > self.current.total:
            self.current = now
        self.last = self.current

    def breakdown(self) -> MemoryBreakdown:
        return self.last


def _tensors(x):
    """The tensors in x: a tensor, None, or nested lists, tuples and dict values of them."""
    if x is None:
        return
    if torch.is_tensor(x):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)


def _grads(tensors):
    return [t.grad for t in _tensors(tensors)]


def terms_held(opt, model) -> list[tuple[str, str, str, list]]:
    """(part, place, what, tensors) for every model-state buffer of DeepSpeed's ZeRO
    optimizer. `place` is where DeepSpeed keeps it: "device", or "cpu" when offloaded."""
    inner = getattr(opt, "optimizer", opt)
    state = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]
    buckets = [b.buffer for b in getattr(opt, "ipg_buckets", {}).values()]
    if not hasattr(opt, "bit16_groups_flat") and not hasattr(opt, "fp16_partitioned_groups_flat"):
        # stage 0: DeepSpeed's data parallel (bf16: FP16_UnfusedOptimizer's fp32 copies; fp32: AdamW)
        master = getattr(opt, "fp32_groups", None)
        return [
            ("params", "device", "weights, whole model", [p.data for p in model.parameters()]),
            ("optim", "device", "fp32 master weights (bf16 runs)", master),
            ("optim", "device", "Adam moments", state),
            ("grads", "device", "gradients, whole model", [p.grad for p in model.parameters()] + _grads(master)),
        ]
    if hasattr(opt, "bit16_groups_flat"):  # stage 0-2: DeepSpeedZeroOptimizer
        home = "cpu" if opt.cpu_offload else "device"
        params = [p for group in opt.bit16_groups for p in group]
        return [
            ("params", "device", "weights, whole model (bf16, or fp32 in fp32 runs)", opt.bit16_groups_flat),
            (
                "params",
                home,
                "copy of the own weight shard for the upload (offload: pinned host memory)",
                getattr(opt, "param_buffer_of_bit16_for_cpu_offload_groups", None),
            ),
            (
                "params",
                "device",
                "frozen weights, whole (model.lora's base: no optimizer group holds them)",
                [p.data for p in model.parameters() if not p.requires_grad],
            ),
            ("optim", home, "fp32 master shard", opt.single_partition_of_fp32_groups),
            ("optim", home, "Adam moments of the shard", state),
            (
                "grads",
                "device",
                "bf16 gradients, whole model (accumulated between micro-batches)",
                [p.grad for p in params],
            ),
            ("grads", "device", "bf16 gradient shard", [opt.averaged_gradients, opt.all_grad_tensors]),
            ("grads", "device", "reduce buckets", buckets),
            ("grads", home, "fp32 gradient shard for the update", _grads(opt.single_partition_of_fp32_groups)),
            (
                "grads",
                "cpu",
                "bf16 gradient shard accumulated in host memory (offload)",
                getattr(opt, "accumulated_grads_in_cpu", None),
            ),
            ("grads", "cpu", "host copy buffer (offload)", getattr(opt, "temp_grad_buffer_for_cpu_offload", None)),
            ("grads", "device", "device copy buffer (offload)", getattr(opt, "temp_grad_buffer_for_gpu_offload", None)),
        ]
    # stage 3: DeepSpeedZeroOptimizer_Stage3
    home = "cpu" if opt.offload_optimizer else "device"
    param_home = "cpu" if opt.offload_param else "device"
    return [
        ("params", param_home, "weight shard", opt.fp16_partitioned_groups_flat),
        (
            "params",
            "device",
            "whole weights: persistent small parameters and any gathered now",
            [p.data for p in model.parameters() if p.data.numel()],
        ),
        (
            "params",
            param_home,
            "frozen weights' partitions (model.lora's base: no optimizer group holds them)",
            [p.ds_tensor for p in model.parameters() if not p.requires_grad],
        ),
        ("optim", home, "fp32 master shard", opt.fp32_partitioned_groups_flat),
        ("optim", home, "Adam moments of the shard", state),
        ("grads", home, "bf16 gradient shard", [opt.grad_partitions_flat_buffer, opt.averaged_gradients]),
        ("grads", "device", "reduce buckets", buckets),
        ("grads", home, "fp32 gradient shard for the update", _grads(opt.fp32_partitioned_groups_flat)),
    ]


def count(terms, device: torch.device) -> MemoryBreakdown:
    """Bytes per part, each storage once. On CUDA a tensor's place is its device; on a
    CPU-only machine both are host memory, and the place is the one DeepSpeed chose."""
    seen: set[int] = set()
    sizes = {"params": 0, "grads": 0, "optim": 0}
    places: dict[str, set] = {part: set() for part in sizes}
    host = 0
    for part, place, _what, tensors in sorted(terms, key=lambda t: ("params", "optim", "grads").index(t[0])):
        for t in _tensors(tensors):
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            where = ("cpu" if t.device.type == "cpu" else "device") if device.type == "cuda" else place
            sizes[part] += storage.nbytes()
            places[part].add(where)
            host += storage.nbytes() if where == "cpu" else 0
    where = {part: "+".join(sorted(p, key=["device", "cpu"].index)) or "device" for part, p in places.items()}
    return MemoryBreakdown(params=sizes["params"], grads=sizes["grads"], optim=sizes["optim"], where=where, host=host)

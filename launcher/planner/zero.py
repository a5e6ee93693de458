"""DeepSpeed's ZeRO model states per rank, term by term, each traced to the line of DeepSpeed
0.19.8 (deepspeed/runtime/zero/) that allocates it and to the setting that governs it;
docs/memory.md ("DeepSpeed's terms, line by line") has the table. The settings are read as the
engine reads them: recipe.zero.* through launcher/parallel/ds_config.py, the others from
recipe.zero.extra.zero_optimization with DeepSpeed's own defaults (DEFAULTS; a unit test
checks them against deepspeed.runtime.zero.config.DeepSpeedZeroConfig).
"""

from __future__ import annotations

import functools

from launcher.config import ModelConfig, from_shape_key, shape_key
from launcher.parallel import ds_config
from launcher.planner import lora
from launcher.planner.memory import _meta_gpt

DEFAULTS = {"sub_group_size": 1_000_000_000}
"""DeepSpeedZeroConfig's defaults of the keys the planner reads from recipe.zero.extra."""


def extra_setting(cfg, key: str) -> int:
    """A zero_optimization key the Hydra config does not own: recipe.zero.extra's, or DeepSpeed's default."""
    return int(cfg.recipe.zero.extra.get("zero_optimization", {}).get(key, DEFAULTS[key]))


@functools.lru_cache(maxsize=32)
def _group_sizes(key: tuple) -> tuple[tuple[int, ...], tuple[int, ...]]:
    model = _meta_gpt(from_shape_key(key))
    params = list(model.parameters())  # unique: a tied head is the embedding
    return tuple(p.numel() for p in params if p.ndim >= 2), tuple(p.numel() for p in params if p.ndim < 2)


def straddling(m: ModelConfig, world: int) -> int:
    """Elements DeepSpeed stage 1/2 hold beyond the rank's gradient partition, on the rank
    holding the most: each optimizer group (launcher.rank.engine.param_groups: matrices, then
    vectors, in model order) is flattened, padded to a multiple of 2N and cut into N equal
    partitions; a parameter crossing a partition's edge has its whole gradient kept for the
    reduce (deepspeed/runtime/zero/stage_1_and_2.py, get_all_grad_tensors over
    params_in_partition), not only its part inside. At most two such parameters per
    group and rank: for Llama-3-8B on 8 ranks a crossing embedding alone is half a shard."""
    worst = [0] * world
    for sizes in _group_sizes(shape_key(m)):
        step = -(-sum(sizes) // (2 * world)) * 2
        start = 0
        for size in sizes:
            end = start + size
            for r in range(start // step, min(world, -(-end // step))):
                inside = min(end, (r + 1) * step) - max(start, r * step)
                worst[r] += size - inside if inside < size else 0
            start = end
    return max(worst)


def persistent(m: ModelConfig, threshold: int) -> int:
    """Elements of the parameters ZeRO-3 keeps whole on every rank (numel <= threshold,
    stage3_param_persistence_threshold: deepspeed/runtime/zero/parameter_offload.py,
    mark_persistent_parameters): the norms, under the launcher's default of 10 x dim."""
    return sum(n for sizes in _group_sizes(shape_key(m)) for n in sizes if n <= threshold)


def largest_param(m: ModelConfig) -> int:
    """Elements of the model's largest parameter (the embedding, a SwiGLU matrix, an MoE's stacked experts)."""
    return max(max(sizes, default=0) for sizes in _group_sizes(shape_key(m)))


# ----------------------------------------------------------------------------- ZeRO model states
def zero_paper_bytes(stage: int, psi: float, world: int) -> float:
    """The ZeRO paper's model states per rank for mixed-precision Adam (Rajbhandari et al.,
    2020, figure 1): Ψ parameters, N ranks."""
    n = world
    return {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]


def zero_states(
    stage: int,
    psi: float,
    world: int,
    grad_accum: int = 1,
    offload_optimizer: bool = False,
    offload_param: bool = False,
    largest_param: int = 0,
    weight_bytes: int = 2,
    straddle: int = 0,
    kept_whole: int = 0,
    bucket: int = 0,
    sub_group: float | None = None,
) -> dict[str, tuple[float, float]]:
    """What DeepSpeed 0.19 really holds per rank at the peak of a step with Adam:
    {"params" | "grads" | "optim": (device bytes, host bytes)}. w = weight_bytes: 2 for
    bf16/fp16 weights, 4 in fp32. Measured in every cell by tests/e2e/test_plan_runs.py (the
    planner's matrix) and tests/e2e/test_zero.py (engines/zero/engine.py::model_state_bytes sums it).

    The paper's terms, plus two it leaves out. For the update DeepSpeed makes an fp32 copy
    of the rank's gradient shard (4Ψ/N) next to the shard it reduced into (wΨ/N); and it
    keeps an fp32 master shard (4Ψ/N) even when the weights are fp32 themselves (fp32
    runs hold 4Ψ weights + 4Ψ/N master: deepspeed/runtime/zero/stage_1_and_2.py,
    `single_partition_of_fp32_groups` is a `.clone().float()` of the weights' shard;
    stage3.py `_create_fp32_partitions` likewise). So, per rank:
        stage 1: wΨ + 12Ψ/N + max(wΨ whole gradients + a bucket while accumulating, (w+4)Ψ/N shards)
        stage 2: wΨ + 12Ψ/N + (w+4)Ψ/N
        stage 3: wΨ/N + 12Ψ/N + wΨ/N + 4S
        stage 0 (bf16, not a recipe): 2Ψ weights + 2Ψ + 4Ψ grads + 4Ψ master + 8Ψ moments
    Stage 1/2's reduce buckets (`bucket` elements) are made at backward's start and freed
    when the reduction ends (stage_1_and_2.py:3256-3277 `setup_buckets`, 924-932
    `_release_ipg_buffers`): stage 2 reduces every backward, so they are never held at the
    step; stage 1 reduces only at the accumulation boundary, so under accumulation its bucket
    lives beside the whole gradients from the first micro-batch on (measured: a bucket of
    the whole model, gloo's default, is exactly 4Ψ more in fp32: tests/e2e/test_zero.py).
    Left out, each under 2% here: padding of the shards to the world size, Adam's step counters.
    Offload: _offloaded.
    """
    n, p, w = world, psi, weight_bytes
    if stage == 0:
        return {"params": (2 * p, 0.0), "grads": (6 * p, 0.0), "optim": (12 * p, 0.0)}
    edges = w * straddle if stage in (1, 2) else 0
    kept = w * kept_whole if stage == 3 and n > 1 else 0.0
    buckets = w * bucket if stage == 3 else 0.0
    # stage 1 accumulates into whole gradients, its reduce bucket already made
    whole = w * (p + bucket) if stage == 1 and grad_accum > 1 else 0.0
    params = w * p / n if stage == 3 else w * p
    if offload_optimizer:
        return _offloaded(stage, p, n, w, grad_accum, offload_param, largest_param, edges, kept, buckets, whole, params)
    grad_shards = (w * p / n + 4 * (p / n if sub_group is None else sub_group)) if stage == 3 else (w + 4) * p / n
    grads = max(whole, grad_shards + edges) if stage == 1 else grad_shards + edges + buckets
    return {"params": (params + kept, 0.0), "grads": (grads, 0.0), "optim": (12 * p / n, 0.0)}


def _offloaded(
    stage: int,
    p: float,
    n: int,
    w: int,
    grad_accum: int,
    offload_param: bool,
    largest_param: int,
    edges: float,
    kept: float,
    buckets: float,
    whole: float,
    params: float,
) -> dict[str, tuple[float, float]]:
    """Optimizer offload: moves the fp32 master, the moments and the fp32 gradient shard to host memory.
    Stage 1/2 keep a copy of the own weight shard for the upload (wΨ/N, counted with the
    weights) in host memory: `temp_buffer_bit16` is made on the fp32 master shard's device,
    the CPU under offload, and pinned (stage_1_and_2.py:278, 560-575) and one copy buffer of the largest parameter on each side
    (w x largest_param bytes, device and host; counted as gradients); while accumulating
    (grad_accum > 1) the reduced gradient shard is summed in host memory (wΨ/N). Stage 3
    keeps its gradient shard (wΨ/N) in host memory; parameter offload moves the weight
    shard there too. Stage 1/2 also keep the whole gradients of the parameters that cross
    the edge of the rank's partition (`straddle` elements beyond it: `straddling`) in the
    shard they reduce into, or accumulate in host memory. Stage 3 keeps its persistent
    parameters (`kept_whole` elements: `persistent`) whole on the device beside the shard
    (on more than one rank: on one, the shard is the whole parameter), and reduces
    gradients through a device bucket of `bucket` elements (reduce_bucket_size), with
    offload too. Stage 3 makes the fp32 gradient for one optimizer sub-group at a time:
    S = `sub_group` elements, the largest (largest_sub_group; Ψ/N when None), not the whole
    partition, unless it offloads (then each sub-group keeps its own fp32 gradient buffer in
    host memory, 4Ψ/N in all: stage3.py:1336-1342). Llama 3 70B on 8 ranks: S = 1.0e9 of
    Ψ/N = 8.8e9 elements, 35 GB of fp32 gradient become 4.
    """
    optim = 12 * p / n
    if stage in (1, 2):
        copy = w * largest_param
        accumulated = w * p / n + edges if grad_accum > 1 else 0.0
        return {
            "params": (params, w * p / n),
            "grads": (whole + copy, 4 * p / n + accumulated + copy),
            "optim": (0.0, optim),
        }
    return {
        "params": (kept, params) if offload_param else (params + kept, 0.0),
        "grads": (buckets, (w + 4) * p / n),
        "optim": (0.0, optim),
    }


def sub_group(cfg, n: int, P: int) -> int:
    """Elements of ZeRO-3's largest optimizer sub-group on one of n ranks (largest_sub_group)
    at recipe.zero.extra.zero_optimization.sub_group_size (DeepSpeed's default 1e9).
    model.lora: the adapters' partition, capped at the sub-group size (they are far below it)."""
    size = extra_setting(cfg, "sub_group_size")
    if lora.enabled(cfg.model):
        return min(-(-P // n), size)
    return largest_sub_group(cfg.model, n, size)


def largest_sub_group(m: ModelConfig, world: int, size: int) -> int:
    """Elements of ZeRO-3's largest optimizer sub-group on one rank. Each optimizer group
    (matrices, then vectors: _group_sizes) is cut into sub-groups by accumulating the
    parameters' partitions (ceil(numel / N) elements, partition_parameters.py:1690-1696,1817)
    until they reach `size` (sub_group_size; stage3.py:1210-1233 `_create_fp16_sub_groups`);
    a group no larger than `size` is one sub-group. The step makes the fp32 gradient and
    its flat 16-bit source for one sub-group at a time (stage3.py:2683-2699
    `_prepare_fp32_grad_for_sub_group`) and frees it after the update (stage3.py:2731-2735
    `_release_sub_group`), and the set-up's gradient buffer is this large
    (stage3.py:1303-1306 `initialize_optimizer_states`)."""
    return _largest_sub_group(shape_key(m), world, size)


@functools.lru_cache(maxsize=64)
def _largest_sub_group(key: tuple, world: int, size: int) -> int:
    largest = 0
    for sizes in _group_sizes(key):
        parts = [-(-n // world) for n in sizes]
        if size >= sum(parts):
            largest = max(largest, sum(parts))
            continue
        run = 0
        for part in parts:
            run += part
            if run >= size:
                largest, run = max(largest, run), 0
        largest = max(largest, run)
    return largest


def gathered(cfg, block: int) -> int:
    """Elements ZeRO-3 holds gathered at once in a step: the `block` that computes and what
    the coordinator prefetches for the next, stage3_prefetch_bucket_size at most and no more
    than stage3_max_live_parameters in all (partitioned_param_coordinator.py:452-457). The
    launcher's default prefetch is one block (ds_config.prefetch_bucket): two blocks."""
    return block + min(ds_config.prefetch_bucket(cfg), max(0, cfg.recipe.zero.max_live_parameters - block))

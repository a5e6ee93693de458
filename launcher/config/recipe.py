"""recipe.* and parallel.*: how the model is spread over the ranks (DDP, FSDP, DeepSpeed
ZeRO, tensor and pipeline parallel degrees), each option with its trade-off.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from launcher.config.enums import OffloadDevice, PPSchedule


@dataclass
class DDPOptions:
    bucket_cap_mb: float = 25.0
    """Gradient all-reduce bucket size. Larger buckets mean fewer, bigger messages (better
    bandwidth) but later overlap with backward; 25 MB is PyTorch's default."""
    gradient_as_bucket_view: bool = True
    """Gradients are views into the all-reduce buckets: saves one copy of the gradients
    (Ψ bytes x grad dtype) at no cost. Turn off only to debug."""
    static_graph: bool = False
    """Promise DDP the graph never changes: lets it skip the unused-parameter search and
    rebuild buckets once. Faster, but wrong if a step takes a different path."""


@dataclass
class FSDPOptions:
    """FSDP2 (`fully_shard`) settings for the recipes that shard (fsdp, tp_fsdp)."""

    reshard_after_forward: bool = True
    """Free each block's gathered parameters after its forward and gather them again in
    backward: parameters cost Ψ/N between layers, for one more all-gather per block. False
    keeps them gathered from forward to backward (less communication, more memory). The
    root (embedding, final norm, head) is gathered through both passes either way and
    never reshards (launcher/parallel/mesh.py::apply_fsdp)."""
    cpu_offload: bool = False
    """Keep the sharded parameters, gradients and optimizer states in host memory and run
    the optimizer step on the CPU: device memory holds only what one block needs, at the
    price of host-device copies every step and a CPU optimizer step."""


@dataclass
class ZeroOptions:
    """DeepSpeed ZeRO (recipe.engine=zero). Every field becomes a key of RUN_DIR/ds_config.json
    (launcher/parallel/ds_config.py); `extra` carries any other DeepSpeed key. Bucket sizes count
    elements, as DeepSpeed does; a null reduce bucket is resolved for the ranks' backend by the
    launch side and written into config.yaml (ds_config.for_backend): model.dim^2 on NCCL (the
    rule Hugging Face's "auto" uses), so buckets grow with the model instead of DeepSpeed's
    fixed 5e8 elements (1-2 GB); on gloo the whole model in one bucket, up to 5e7."""

    stage: int = 1
    """0: no sharding (DeepSpeed's data parallel). 1: shard the optimizer states (fp32 master
    and Adam moments): 4Ψ + 12Ψ/N bytes per rank. 2: also shard gradients, reduced in
    buckets during backward: 2Ψ + 14Ψ/N (DeepSpeed 0.19 all-reduces each bucket, then
    all-gathers the updated weights: 1.5x the paper's traffic, which is DDP's). 3: also shard the
    parameters, all-gathered layer by layer in forward and backward: 16Ψ/N, about 1.5x the
    traffic of DDP. Higher stages fit bigger models on the same ranks and cost more messages."""
    overlap_comm: Optional[bool] = None
    """Reduce gradients while backward still runs (null: DeepSpeed's default, on for stage 3
    only). Hides communication but keeps two reduce buckets alive instead of one."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced: avoids fragmentation
    (stage 2 and 3) at the cost of one copy per gradient."""
    reduce_scatter: bool = True
    """Stage 1/2: reduce each bucket's slices toward the ranks that own them rather than a
    plain all-reduce of the gradients. DeepSpeed 0.19 still does it with one all-reduce a
    bucket, unless recipe.zero.extra sets zero_optimization.use_multi_rank_bucket_allreduce
    false (then a reduce a slice: fewer bytes, more messages). Off only to debug."""
    reduce_bucket_size: Optional[int] = None
    """Elements reduced per message (null: model.dim^2 on NCCL; on gloo every trainable
    element, at most 5e7, because gloo pays about 2 ms a message: bench/deepspeed_defaults.md).
    Bigger buckets use the bandwidth better and hold more memory (one or two buckets of this
    size during backward; stage 3 keeps one for the run)."""
    allgather_bucket_size: Optional[int] = None
    """Stage 1/2: elements all-gathered per message when the updated shards are shared
    after the step (null: model.dim^2). DeepSpeed 0.19 reads it only where torch lacks
    all_gather_into_tensor; with it (any torch 2) the weights go in one all-gather per
    parameter group, whatever this says (runtime/utils.py all_gather_dp_groups)."""
    prefetch_bucket_size: Optional[int] = None
    """Stage 3 (stage3_prefetch_bucket_size): parameter elements fetched ahead of use (null:
    one decoder block's matmul weights, so the next block arrives whole while this one
    computes; 0.9 x dim^2, Hugging Face's "auto", is a twelfth of a Llama block). More
    prefetch hides all-gather latency, holds more gathered weights."""
    param_persistence_threshold: Optional[int] = None
    """Stage 3 (stage3_param_persistence_threshold): parameters smaller than this many
    elements are not sharded but kept whole on every rank (null: 10 x model.dim, the norms).
    Saves many tiny latency-bound all-gathers; costs their full size on every rank."""
    max_live_parameters: int = 1_000_000_000
    """Stage 3 (stage3_max_live_parameters): gathered parameter elements allowed at once
    before the oldest are released. Lower saves memory, costs re-gathers."""
    max_reuse_distance: int = 1_000_000_000
    """Stage 3 (stage3_max_reuse_distance): keep a gathered parameter if it is used again
    within this many elements of computation. Lower saves memory, costs re-gathers."""
    offload_optimizer: OffloadDevice = OffloadDevice.none
    """cpu: keep the fp32 master weights and Adam moments (12Ψ/N) in host memory and run
    the optimizer step there (DeepSpeedCPUAdam, compiled once on first use). Frees device
    memory for bigger models; each step copies gradients down and weights up over PCIe."""
    offload_param: OffloadDevice = OffloadDevice.none
    """Stage 3 only. cpu: keep the parameter shards in host memory too and stream them to the
    device layer by layer: the largest models per device, the slowest steps."""
    pin_memory: bool = True
    """Offload into page-locked host memory: faster, asynchronous copies, but pinned memory
    is scarce and cannot be swapped. Ignored on a CPU-only machine (nothing to pin for)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Raw DeepSpeed config keys merged into the generated JSON, e.g.
    recipe.zero.extra={zero_optimization:{round_robin_gradients:true}}. A key that the Hydra
    config already sets must agree with it (batch sizes, precision, optimizer, clipping:
    change those through train.*, precision.*, optim.*); a key DeepSpeed does not know is
    refused. Both are checked on the launch side with DeepSpeed's own config parser."""


@dataclass
class RecipeConfig:
    """`recipe=<name>` selects conf/recipe/<name>.yaml."""

    name: str = "ddp"
    """The recipe's name, as on the command line (informative; the file sets it)."""
    engine: str = "ddp"
    """The engine that runs the recipe: the engines/ module that builds it (its EngineSpec says what it may split;
    an unknown name is refused with the list). ddp: replicate the model, all-reduce
    gradients: model states cost 16 bytes/param on every rank (mixed-precision Adam).
    fsdp: shard them over dp_shard ranks (16Ψ/N). tp: split the matmuls over tp ranks.
    tp_fsdp: both, on a 2-D mesh. pp: split the layers into pipeline stages. zero: DeepSpeed
    ZeRO (recipe.zero.*): shard optimizer states, gradients and parameters over the ranks for
    less memory per rank and more communication."""
    ddp: DDPOptions = field(default_factory=DDPOptions)
    fsdp: FSDPOptions = field(default_factory=FSDPOptions)
    zero: ZeroOptions = field(default_factory=ZeroOptions)


@dataclass
class ParallelConfig:
    """Parallel degrees: world size = dp_replicate x dp_shard x cp x tp x pp. One device mesh
    (pp, dp_replicate, dp_shard, cp, tp), outermost first, is built from them: tensor-parallel
    ranks are neighbours (the most traffic on the fastest links), pipeline stages the
    furthest apart (the least traffic). Each recipe file names its default degrees
    (conf/parallel/<recipe>.yaml); which degrees a recipe may use is its engine's EngineSpec (engines/<engine>)."""

    dp_replicate: int = 1
    """Data-parallel replicas that all-reduce gradients. With fsdp/tp_fsdp and dp_shard > 1
    this is HSDP: shard within a group of dp_shard ranks, replicate across groups (all-
    reduces cross the slow links only once per step, at the cost of dp_replicate copies)."""
    dp_shard: int = -1
    """Data-parallel ranks that shard parameters, gradients and optimizer states (FSDP):
    model states shrink to 16Ψ/dp_shard, for an all-gather per block in forward and
    backward and a reduce-scatter of gradients. -1: every rank the other degrees leave
    (recipes that do not shard replicate over those ranks instead)."""
    tp: int = 1
    """Tensor-parallel degree: attention heads and the SwiGLU hidden size are split over
    tp ranks (column-wise q/k/v/w1/w3, row-wise wo/w2). Cuts parameters and activations of
    the matmuls by tp, for two all-reduces per block in forward and two in backward: keep
    it within a node. Must divide the heads, the KV heads and the hidden size."""
    sequence_parallel: bool = False
    """tp > 1: also split the norms' activations along the sequence (the all-reduces
    become reduce-scatter + all-gather, same volume): saves activation memory of the norms
    and residual stream by tp. Needs train.seq_len divisible by tp."""
    cp: int = 1
    """Context parallel: each sample's sequence split over cp ranks (recipes ddp, fsdp,
    tp_fsdp; the project's decoder). Every activation, the logits included, shrinks to
    1/cp per rank; attention trades the sequence split for a head split by all-to-all
    (DeepSpeed-Ulysses: 4 all-to-alls per block forward and 4 backward, launcher/parallel/
    context.py). For sequences whose activations do not fit even with checkpointing; it
    costs data parallelism (world = dp x cp x tp x pp), so keep it to what memory needs.
    Must divide train.seq_len and the attention heads (per tensor-parallel rank)."""
    ep: int = 1
    """Expert parallel (an MoE, model.moe.experts > 0): each MoE block's experts split over ep
    ranks, E/ep each; every token goes to the ranks holding its top-k experts and back by two
    all-to-alls per block in forward and two in backward (launcher/models/experts.py). Not a
    degree of its own: the ep ranks are data-parallel ranks (ep divides dp_shard x cp under
    fsdp, as in torchtitan, the world under ddp), so the dense weights keep their
    data-parallel layout and the experts' states shrink by ep (launcher/parallel/experts.py).
    Must divide model.moe.experts; engines ddp and fsdp (dp_replicate 1)."""
    pp: int = 1
    """Pipeline stages: the layers are cut into pp contiguous stages on different ranks,
    activations are sent between them. Only point-to-point traffic, but idle time (the
    bubble, (pp-1)/pp_microbatches of a step for gpipe/1f1b) unless micro-batches are many."""
    pp_schedule: PPSchedule = PPSchedule["1f1b"]
    """gpipe | 1f1b | interleaved_1f1b (see PPSchedule)."""
    pp_microbatches: int = 4
    """Micro-batches the pipeline cuts each data-parallel rank's batch (train.micro_batch x
    grad_accum sequences) into. More shrink the bubble, but each is a smaller matmul. Must
    divide that batch; 1f1b needs at least pp of them."""
    pp_virtual_stages: int = 2
    """interleaved_1f1b: stages per rank (rank r holds stages r, r+pp, ...). The bubble
    shrinks by this factor; each micro-batch crosses the ranks that many times more."""
    pp_split: Optional[list[int]] = None
    """The first layer of every stage but the first, e.g. [2] for pp=2 on 4 layers
    (null: balance the stages by parameter count, the embedding and head included)."""

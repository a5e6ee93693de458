"""Typed configuration: one dataclass per Hydra group, registered in the ConfigStore.

Every option is documented where it is declared, with its trade-off. The YAML files in
`conf/` only choose values; the types, defaults and allowed values live here, so Hydra
refuses unknown keys and wrong types while composing.

The cross-field checks that no single type can express (batch arithmetic, device
capabilities, paths, the model's shape) are launcher/validate.py's. This module imports
nothing else of the project.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf


class ConfigError(ValueError):
    """Bad input: names the key, the value and what is allowed."""

    def __init__(self, key: str, value: Any, allowed: str):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key}={value}: {allowed}")


# ----------------------------------------------------------------------------- enums
class Strategy(str, enum.Enum):
    """Which `recipes/` module builds the engine (the registry key)."""

    ddp = "ddp"
    fsdp = "fsdp"
    tp = "tp"
    pp = "pp"
    tp_fsdp = "tp_fsdp"
    zero = "zero"


# Pipeline schedules. Declared functionally because "1f1b" is not a Python identifier;
# the names are what the command line and config.yaml say (parallel.pp_schedule=1f1b).
PPSchedule = enum.Enum("PPSchedule", {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved_1f1b": "interleaved_1f1b"},
                       type=str)
PPSchedule.__doc__ = """gpipe: all forwards, then all backwards: simplest, but every micro-batch's
activations are alive at once. 1f1b: one forward, one backward in the steady state: the
same bubble, activations of at most `pp` micro-batches. interleaved_1f1b: each rank holds
pp_virtual_stages smaller stages; the bubble shrinks by that factor for more messages."""


class Precision(str, enum.Enum):
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


class ACMode(str, enum.Enum):
    none = "none"
    full = "full"
    selective = "selective"


class DataKind(str, enum.Enum):
    synthetic = "synthetic"
    memmap = "memmap"
    hf_text = "hf_text"


class TextFormat(str, enum.Enum):
    """data=hf_text: how the files are read (`datasets` builder)."""

    auto = "auto"
    json = "json"
    parquet = "parquet"
    text = "text"


class TokenDtype(str, enum.Enum):
    uint16 = "uint16"
    uint32 = "uint32"


class LoggerKind(str, enum.Enum):
    wandb = "wandb"
    none = "none"
    tensorboard = "tensorboard"


class OnExisting(str, enum.Enum):
    """What a fresh start does in a checkpoint folder that holds another run's checkpoints."""

    refuse = "refuse"
    archive = "archive"


class WandbMode(str, enum.Enum):
    auto = "auto"
    online = "online"
    offline = "offline"


class Backend(str, enum.Enum):
    auto = "auto"
    nccl = "nccl"
    gloo = "gloo"


class Runner(str, enum.Enum):
    torchrun = "torchrun"
    deepspeed = "deepspeed"


class OffloadDevice(str, enum.Enum):
    """Where ZeRO keeps a part of the model state: on the accelerator, or in host memory."""

    none = "none"
    cpu = "cpu"


class Scheduler(str, enum.Enum):
    """Who starts the nodes: nobody (`make train` here, other nodes by hand) or Slurm."""

    none = "none"
    slurm = "slurm"


class ExportFormat(str, enum.Enum):
    safetensors = "safetensors"
    hf = "hf"


class ModelKind(str, enum.Enum):
    """gpt: the project's decoder (launcher/models/gpt.py); hf: a transformers causal LM."""

    gpt = "gpt"
    hf = "hf"


class HFAttention(str, enum.Enum):
    """model=hf: transformers' attention implementation (config._attn_implementation)."""

    sdpa = "sdpa"
    eager = "eager"


class ExportDtype(str, enum.Enum):
    fp32 = "fp32"
    bf16 = "bf16"


# ----------------------------------------------------------------------------- groups
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
    keeps them gathered from forward to backward (less communication, more memory)."""
    cpu_offload: bool = False
    """Keep the sharded parameters, gradients and optimizer states in host memory and run
    the optimizer step on the CPU: device memory holds only what one block needs, at the
    price of host-device copies every step and a CPU optimizer step."""


@dataclass
class ZeroOptions:
    """DeepSpeed ZeRO (recipe.strategy=zero). Every field becomes a key of RUN_DIR/ds_config.json
    (launcher/ds_config.py); `extra` carries any other DeepSpeed key. Bucket sizes count
    elements, as DeepSpeed does; null = model.dim^2 (the rule Hugging Face's "auto" uses),
    so buckets grow with the model instead of DeepSpeed's fixed 5e8 elements (1-2 GB)."""

    stage: int = 1
    """0: no sharding (DeepSpeed's data parallel). 1: shard the optimizer states (fp32 master
    and Adam moments): 4Ψ + 12Ψ/N bytes per rank. 2: also shard gradients, reduce-scattered
    in buckets during backward: 2Ψ + 14Ψ/N, the same traffic as DDP. 3: also shard the
    parameters, all-gathered layer by layer in forward and backward: 16Ψ/N, about 1.5x the
    traffic of DDP. Higher stages fit bigger models on the same ranks and cost more messages."""
    overlap_comm: Optional[bool] = None
    """Reduce gradients while backward still runs (null: DeepSpeed's default, on for stage 3
    only). Hides communication but keeps two reduce buckets alive instead of one."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced: avoids fragmentation
    (stage 2 and 3) at the cost of one copy per gradient."""
    reduce_scatter: bool = True
    """Average gradients with reduce-scatter (each rank receives only its shard) rather than
    all-reduce: half the received bytes. Off only to debug."""
    reduce_bucket_size: Optional[int] = None
    """Elements reduced per message (null: model.dim^2). Bigger buckets use the bandwidth
    better and hold more memory (one or two buckets of this size during backward)."""
    allgather_bucket_size: Optional[int] = None
    """Stage 1/2: elements all-gathered per message when the updated shards are shared
    after the step (null: model.dim^2). Bigger = fewer messages, a bigger temporary buffer."""
    prefetch_bucket_size: Optional[int] = None
    """Stage 3 (stage3_prefetch_bucket_size): parameter elements fetched ahead of use (null:
    0.9 x model.dim^2). More prefetch hides all-gather latency, holds more gathered weights."""
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
    strategy: Strategy = Strategy.ddp
    """The recipes/ module that builds the engine. ddp: replicate the model, all-reduce
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
    """Parallel degrees: world size = dp_replicate x dp_shard x tp x pp. One device mesh
    (pp, dp_replicate, dp_shard, tp), outermost first, is built from them: tensor-parallel
    ranks are neighbours (the most traffic on the fastest links), pipeline stages the
    furthest apart (the least traffic). Each recipe file names its default degrees
    (conf/parallel/<recipe>.yaml); which degrees a recipe may use is in RECIPE_PARALLELISM."""

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


@dataclass
class ModelConfig:
    """The project's Llama-style decoder (launcher/models/gpt.py)."""

    name: str = "gpt_tiny"
    vocab_size: int = 256
    """Embedding rows. Must cover the data's vocabulary."""
    dim: int = 128
    """Hidden size. Cost grows with dim^2 per token for parameters and FLOPs."""
    n_layers: int = 4
    n_heads: int = 4
    """Attention heads; dim must divide by it (head_dim = dim / n_heads)."""
    n_kv_heads: Optional[int] = None
    """Key/value heads for grouped-query attention (null = n_heads). Fewer heads shrink the
    KV projections and cache; must divide n_heads."""
    ffn_dim: Optional[int] = None
    """SwiGLU hidden size (null = 8/3 * dim rounded up to multiple_of)."""
    multiple_of: int = 64
    """Round ffn_dim up to this (tensor-core friendly shapes)."""
    max_seq_len: int = 512
    """Longest sequence the rotary table covers; train.seq_len must not exceed it."""
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    """Share the input embedding with the output head: saves vocab*dim parameters, which
    matters for small models; large models usually untie."""
    init_std: float = 0.02

    # ---- model=hf (conf/model/hf.yaml): a transformers causal LM from local files only.
    # The fields above shape the project's decoder; with kind=hf the shape comes from the
    # Hugging Face config and they are not used.
    kind: ModelKind = ModelKind.gpt
    """gpt: the project's decoder, shaped by the fields above. hf: any causal LM that
    transformers (the optional `hf` extra) builds offline from `config` or `pretrained`;
    nothing is fetched from a hub (HF_HUB_OFFLINE=1 on the launch side and the ranks).
    Tensor and pipeline parallel need a Llama-family layout (launcher/models/hf.py)."""
    config: Optional[str] = None
    """hf: a config.json (or the folder holding one): AutoModelForCausalLM.from_config,
    random init from train.seed, the same on every rank. Cheap to try shapes; it starts
    from nothing."""
    pretrained: Optional[str] = None
    """hf: a local folder with config.json and *.safetensors weights (save_pretrained's
    layout): the structure from its config.json, each rank reading only the tensor slices
    it holds, in fp32 (the master copy; precision.name decides the compute dtype); names
    must match the model's own (no key conversion: MoE folders that need transformers'
    conversion mapping are refused). Exactly one of config/pretrained."""
    attn_implementation: HFAttention = HFAttention.sdpa
    """hf: sdpa (torch's fused attention; the causal mask is implicit, no mask tensor)
    or eager (transformers' matmul-softmax reference: slower, materialises seq^2 scores)."""


@dataclass
class DataConfig:
    name: DataKind = DataKind.synthetic
    """synthetic: an order-k Markov source generated from a seed, with a known entropy
    rate (the loss floor). memmap: a flat token file (.bin) as nanoGPT writes it;
    scripts/prepare_data.py makes one from a local text file."""
    vocab_size: int = 256
    """synthetic: alphabet of the source. memmap: the largest token id + 1 in the file
    (256 for scripts/prepare_data.py's byte-level encoding). hf_text: unused (the
    tokenizer's vocabulary is checked against the model's embedding)."""
    order: int = 2
    """synthetic: the next token depends on this many previous tokens. Higher orders are
    harder to learn in a short run."""
    context_bits: int = 2
    """synthetic: the context is the previous token plus the low `context_bits` bits of
    each of the order-1 tokens before it: vocab_size * 2^(context_bits * (order-1))
    contexts, each with its own next-token distribution. More contexts = more to learn."""
    temperature: float = 1.0
    """synthetic: in each context the i-th likeliest token has probability ∝ exp(-i /
    temperature). 1.0 gives an entropy rate of 1.04 nats; lower is easier to predict."""
    seed: int = 0
    """synthetic: the source's seed (its transition tables). Different from train.seed."""
    path: Optional[str] = None
    """memmap: path to the token file."""
    dtype: TokenDtype = TokenDtype.uint16
    """memmap: token width in the file (uint16 covers vocabularies up to 65536)."""
    num_workers: Optional[int] = None
    """DataLoader worker processes per rank (null: 2 on CUDA, 0 on CPU where the cores
    are busy with the ranks). Workers hide data time but cost CPU and memory."""
    prefetch_factor: int = 2
    """Batches each worker prepares ahead (only with workers)."""
    pin_memory: bool = True
    """Page-locked host buffers on CUDA for faster, asynchronous copies (ignored on CPU)."""
    files: Any = None
    """hf_text: a glob or a list of globs of local files (`'corpus/*.jsonl'`, `[a.parquet,
    'b/*.parquet']`); relative to the directory the launcher runs in. All files must have
    one format. Documents are tokenized once, on the launch side, before any rank starts."""
    format: TextFormat = TextFormat.auto
    """hf_text: json (JSON lines, one document per line), parquet, text (one document per
    line) or auto: from the files' extension (.jsonl/.json, .parquet, .txt/.text)."""
    text_field: str = "text"
    """hf_text: the column holding each document's text (plain text files have only
    `text`). A missing field is refused before launch, naming the fields there are."""
    tokenizer: str = "byte"
    """hf_text: `byte`: the project's byte-level encoding (UTF-8 bytes, vocabulary 256, as
    scripts/prepare_data.py), end of document = 255, a byte UTF-8 text never contains, so
    the vocabulary stays 256; or a local folder AutoTokenizer loads offline (tokenizer.json,
    tokenizer_config.json...; a model folder with them works too); its EOS token ends each
    document. Its vocabulary must fit the model's embedding."""


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 1e-3
    """Peak learning rate, reached after warm-up."""
    min_lr_ratio: float = 0.1
    """Cosine decays to lr * min_lr_ratio at the last step."""
    warmup_steps: int = 20
    """Linear warm-up from 0; stabilises Adam's early, noisy second-moment estimates. Longer
    than train.steps: clamped to it, with a warning (a short run warms up throughout)."""
    weight_decay: float = 0.1
    """Decoupled decay on matrices only (norms and biases are not decayed)."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = off). Guards against loss spikes."""
    fused: Optional[bool] = None
    """Fused AdamW kernel (null: on for CUDA, off on CPU where it does not exist)."""


@dataclass
class PrecisionConfig:
    name: Precision = Precision.bf16
    """bf16: autocast to bfloat16, fp32 master weights; same range as fp32, no scaler.
    fp16: autocast to float16 with a dynamic loss scaler (CUDA only); fp32: no autocast,
    slowest on tensor cores, the reference for correctness checks."""
    initial_scale: float = 65536.0
    """fp16: the loss scale to start from (halved on overflow)."""
    growth_interval: int = 1000
    """fp16: steps without overflow before the scale doubles."""
    min_scale: float = 1.0
    """fp16: the scale never drops below this (DeepSpeed's min_loss_scale)."""


@dataclass
class CheckpointConfig:
    every: int = 100
    """Save every N optimizer steps (0 = only at the end). Frequent saves lose less work
    on a crash but cost write time (the whole model state per save)."""
    keep: int = 3
    """Keep the newest K complete checkpoints; older ones are deleted after a save."""
    resume: str = "auto"
    """auto: continue from the run directory's latest checkpoint if there is one;
    never: start fresh; or a path to a checkpoint folder (step_000100) to start from."""
    dir: Optional[str] = None
    """Where checkpoints go (null = RUN_DIR/checkpoints)."""
    save_final: bool = True
    """Save at the last step even when it is not a multiple of `every`."""
    async_save: bool = False
    """Write checkpoints in the background: training stops only while each rank copies its
    state into host memory (pinned on CUDA; for zero*, DeepSpeed's own save bookkeeping
    too), then goes on while a thread writes, hashes and
    publishes it (DCP's async_save for fsdp/tp/tp_fsdp/pp; a staged copy of DeepSpeed's and
    ddp's files). Costs host memory, this rank's share of the checkpoint, for the life of
    the run; at most one save is in flight (the next one, a stop signal and the end of the
    run wait for it: cluster.shutdown_timeout_s must cover the rest of it plus one save).
    The guarantees are the same: a kill while it writes leaves the previous checkpoint and
    `latest` whole."""
    on_existing: OnExisting = OnExisting.refuse
    """A fresh start (resume=never, or resume= a checkpoint other than the folder's newest)
    where the checkpoint folder already holds a run's checkpoints. refuse (exit 2): two runs
    never share a folder. archive: first move that run aside, its checkpoints and the run
    directory's record of it (config.yaml, metrics.jsonl, summary.json, W&B id) to
    RUN_DIR/archive/<its run id>/; nothing is deleted (launcher/identity.py)."""
    run_id: Optional[str] = None
    """The run the checkpoints belong to, written into every manifest and `latest`; keep-K
    and resume=auto only touch this run's. Set by the launcher: a launch that continues a run
    keeps its id, a fresh start gets a new one (name one by hand only for a fresh start)."""


@dataclass
class LoggerConfig:
    name: LoggerKind = LoggerKind.wandb
    """wandb: Weights & Biases run (offline files in RUN_DIR/wandb without an API key);
    tensorboard: event files in RUN_DIR/tensorboard (`tensorboard --logdir RUN_DIR`);
    none: console and metrics.jsonl only. Every sink gets the same metric names."""
    also: list[LoggerKind] = field(default_factory=list)
    """More sinks beside `name`, e.g. `logger=wandb logger.also=[tensorboard]`: each costs
    rank 0 a write per log step, nothing on the other ranks."""
    mode: WandbMode = WandbMode.auto
    """auto: online when an API key is configured, else offline."""
    project: str = "launcher"
    entity: Optional[str] = None
    group: Optional[str] = None
    tags: list[str] = field(default_factory=list)
    log_every: int = 10
    """Log every N steps. Each log reduces the loss across ranks and syncs the device:
    logging every step costs a little throughput."""


@dataclass
class ClusterConfig:
    name: str = "local"
    runner: Runner = Runner.torchrun
    """How ranks start: torchrun (python -m torch.distributed.run), or deepspeed (DeepSpeed's
    own launcher, `deepspeed --num_nodes --num_gpus`, recipe.strategy=zero only; several nodes
    are started from the first one over ssh/pdsh with a generated RUN_DIR/hostfile)."""
    hosts: list[str] = field(default_factory=list)
    """runner=deepspeed with nnodes > 1: the nodes' hostnames, the first one runs the launcher
    (written to RUN_DIR/hostfile with nproc_per_node slots each; needs passwordless ssh)."""
    nproc_per_node: Optional[int] = None
    """Processes per node (null: every GPU; 2 on a CPU-only machine)."""
    gpus_per_node: Optional[int] = None
    """GPUs a node offers (null: detect). nproc_per_node may not exceed it."""
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    """Rendezvous host: the first node's address in a multi-node job."""
    master_port: Optional[int] = None
    """Rendezvous port (null: a free port on this machine, single node only)."""
    max_restarts: int = 0
    """torchrun restarts the whole group this many times after a failure; each restart
    resumes from the latest checkpoint."""
    shutdown_timeout_s: int = 300
    """After a stop signal (SIGTERM, SIGUSR1) the ranks finish the step and save; torchrun
    kills them after this long. Must cover one step plus one checkpoint save (with
    checkpoint.async_save: plus what is left of a save still being written)."""
    cpu_threads: Optional[int] = None
    """Threads per rank on CPU (null: cores / processes, at least 1)."""
    gpu_memory_gb: Optional[float] = None
    """Memory of one GPU, for the planner (null: read from nvidia-smi; required on a
    machine without GPUs when planning for one)."""
    scheduler: Scheduler = Scheduler.none
    """none: `make train` starts the ranks on this machine (several nodes: run it on each
    with nnodes, node_rank, master_addr, master_port). slurm: `make submit` renders
    RUN_DIR/job.sbatch and hands it to sbatch; `make train` refuses such a config."""
    join_timeout_s: Optional[int] = None
    """Seconds the nodes wait for each other at the rendezvous (null: dist.timeout_s). A
    node that has not joined by then ends the job with a message naming it. Long enough
    for the slowest node to start (image pulls, module loads); short to notice a dead one."""
    rdzv_timeout_s: int = 30
    """Seconds a node other than 0 waits for node 0's rendezvous to answer at
    master_addr:master_port (node 0 opens it as its launcher starts). Short, so that a wrong
    address or port is said within seconds; raise it when node 0 may start well after the
    others. Once node 0 answers, cluster.join_timeout_s applies."""
    local_addr: Optional[str] = None
    """This node's address as the other nodes reach it (torchrun --local-addr; rank 0's
    node hosts the ranks' store there). null: the host's name, right unless that name
    resolves to an address the others cannot reach (several networks, containers)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment for the ranks on every node, e.g. NCCL and network settings:
    NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME (the interface collectives use; pick the fast
    one, not the management network), NCCL_IB_HCA, NCCL_DEBUG=INFO (verbose: for hangs).
    Set one with `+cluster.env.NAME=value`. Values are shell-quoted where they are written."""

    # ---- Slurm (scheduler: slurm); `make submit` writes them as #SBATCH lines
    partition: Optional[str] = None
    """--partition (null: the cluster's default partition)."""
    account: Optional[str] = None
    """--account to charge (null: your default account)."""
    qos: Optional[str] = None
    """--qos (null: the default). A preemptible QOS often starts sooner; pair it with
    requeue so a preempted job carries on by itself."""
    time: Optional[str] = None
    """--time limit: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS (null: the
    partition's default). Shorter jobs are scheduled sooner (backfill); a run longer than
    the limit saves at the warning signal and requeues itself."""
    cpus_per_task: Optional[int] = None
    """CPUs for the one task per node, shared by its ranks and their data loaders (null:
    Slurm's default, often 1 CPU for the whole node's ranks: set it)."""
    mem: Optional[str] = None
    """--mem per node: a number with an optional K/M/G/T suffix; 0 = all of the node's
    memory (null: the partition's default)."""
    constraint: Optional[str] = None
    """--constraint: node features, e.g. a100|h100 (null: any node of the partition)."""
    exclusive: bool = False
    """--exclusive: no other job shares the nodes. Steadier speed (no neighbour on the
    memory bus or the network card), but the whole nodes are charged."""
    sbatch_extra: list[str] = field(default_factory=list)
    """More #SBATCH options, one per entry, written as given after the others (they win),
    e.g. ["--gres=gpu:a100:8", "--reservation=big"]. Each starts with '-'."""
    setup: list[str] = field(default_factory=list)
    """Shell lines the job runs before the ranks start, as written (this is shell code,
    not quoted): `module load cuda/12.4`, `source /shared/venv/bin/activate`..."""
    preempt_grace_s: int = 300
    """Slurm sends SIGUSR1 this many seconds before the time limit (--signal=B:USR1@N; it
    may come up to 60 s early): the ranks finish the step, save and the job requeues.
    Must cover shutdown_timeout_s (one step plus one save). Longer loses more of the
    allocation; shorter risks the time limit striking during the save (the previous
    checkpoint then stays the latest)."""
    requeue: bool = True
    """After a warning signal the job requeues itself (scontrol requeue) and the requeued
    job resumes from the run directory's latest checkpoint, in the same W&B run. false:
    it saves and ends (resume by hand: sbatch job.sbatch in the run directory)."""
    max_requeues: int = 20
    """Requeues one job may make (Slurm's own requeues after a node failure count too).
    Bounds a job that keeps being stopped; failures that are not preemptions are never
    requeued by the job (torchrun's max_restarts covers those within the job)."""


@dataclass
class TrainConfig:
    steps: int = 200
    """Optimizer steps."""
    micro_batch: int = 8
    """Sequences per rank per forward/backward. Activation memory grows linearly with it."""
    grad_accum: int = 1
    """Micro-batches per optimizer step. Larger global batch at no memory cost, but
    proportionally more time per step."""
    global_batch: Optional[int] = None
    """Sequences per optimizer step over all ranks. When set, grad_accum is derived:
    global_batch / (micro_batch x data-parallel size), which must divide exactly."""
    seq_len: int = 128
    """Tokens per sequence. Attention activations grow with its square (without flash)."""
    stop_at: Optional[int] = None
    """End this launch after this step, with a checkpoint; the schedule still spans
    train.steps, so a later launch of the same run directory carries on (time-sliced
    jobs, tests of resume). A launch that starts at or past it (RUN_DIR/command.sh run
    again, a requeue, whose config.yaml still says it) trains on to train.steps.
    null = run to train.steps."""
    seed: int = 1234
    """Seeds model init and every RNG; the same seed gives the same run on CPU."""
    activation_checkpointing: ACMode = ACMode.none
    """none: keep all activations. full: recompute every block in backward (about a third
    more compute, activations shrink to one tensor per block). selective: recompute every
    ac_every-th block, a middle ground."""
    ac_every: int = 2
    """selective: recompute every N-th block."""
    compile: bool = False
    """torch.compile each block: faster steps after a compile pause at the start."""
    measure_activations: bool = False
    """Count the bytes autograd saves for backward during the second step of the launch
    (saved_tensors_hooks) and log them as mem/activation_bytes: checks the planner's
    prediction on real hardware. Costs a little time on that one step."""


@dataclass
class DistConfig:
    backend: Backend = Backend.auto
    """auto: nccl on CUDA, gloo on CPU."""
    timeout_s: int = 600
    """Collective timeout: a rank that stops answering ends the job after this long."""


class FaultPoint(str, enum.Enum):
    """Where `debug.fault` strikes (reliability tests; never set it for real training)."""

    save_staged = "save_staged"
    """checkpoint.async_save: SIGKILL of the rank from its writer thread, after the state
    was staged and training went on, before that thread writes (DCP's own writer may have
    begun)."""
    save_engine_written = "save_engine_written"
    """SIGKILL after every rank wrote its part of the checkpoint, before the manifest."""
    save_manifest_written = "save_manifest_written"
    """SIGKILL after the manifest, before the folder is renamed into place."""
    save_renamed = "save_renamed"
    """SIGKILL after the rename, before `latest` is updated."""
    save_latest_written = "save_latest_written"
    """SIGKILL after `latest` is updated, before old checkpoints are deleted."""
    hang = "hang"
    """The rank sleeps forever instead of fetching the batch of step `fault_step`."""


@dataclass
class DebugConfig:
    """Fault injection for the reliability tests: a real SIGKILL or a real sleep at a
    named point, on one rank, at one step. Off (null) in every real run."""

    fault: Optional[FaultPoint] = None
    fault_step: int = 1
    """The step at (or during whose checkpoint save) the fault strikes."""
    fault_rank: int = 0
    """The global rank it strikes."""
    async_save_delay_s: float = 0.0
    """checkpoint.async_save: each rank's writer thread waits this long before it writes,
    while training goes on (a staged copy that still shared the live tensors would then be
    written changed; tests)."""
    startup_digest: bool = False
    """Add summary.json's startup.weights_digest: sha256 of the consolidated fp32 weights
    when the engine is ready (step 0), equal at every layout for one train.seed. Gathers the
    whole model on every rank: for tests and small models only."""


@dataclass
class ProfileConfig:
    """`profile.enabled=true profile.steps=[5,8]`: a torch.profiler trace of those steps,
    per rank, in RUN_DIR/profile/ (Chrome trace JSON named as TensorBoard's profiler
    plugin expects: open it in Perfetto (ui.perfetto.dev) or TensorBoard); on CUDA also
    the allocator's memory snapshot (memory_snapshot_rank<r>.pickle, for
    pytorch.org/memory_viz). Profiled steps run slower: leave it off for real training."""

    enabled: bool = False
    steps: list[int] = field(default_factory=lambda: [5, 8])
    """[first, last] optimizer step to record, both included (steps count from 1). Skip
    the first steps: they hold one-time work (allocator warm-up, compile, shape inference)."""
    record_shapes: bool = True
    """Record each operator's input shapes (group kernels by shape); a little overhead."""
    profile_memory: bool = True
    """Record tensor allocations and frees (the memory timeline); more overhead and a
    larger trace."""
    with_stack: bool = False
    """Record the Python stack of every operator (find the source line); much larger
    traces and slower steps."""


@dataclass
class ExportConfig:
    """`make export RUN=RUN_DIR` (launcher export RUN_DIR export.key=value ...)."""

    format: ExportFormat = ExportFormat.safetensors
    """safetensors: the project's model weights in one file (metadata holds the model config).
    hf: a folder AutoModelForCausalLM.from_pretrained loads (config.json, safetensors
    shards, generation config, the run's tokenizer when the data named a local one);
    model=hf exports its own class, the project's decoder exports as LlamaForCausalLM."""
    dtype: ExportDtype = ExportDtype.fp32
    """fp32 keeps the master weights exactly; bf16 halves the file for inference."""
    step: Optional[int] = None
    """Which checkpoint (null = the latest complete one)."""
    out: Optional[str] = None
    """Output folder (null = RUN_DIR/export/step_XXXXXXXX, with -hf for format=hf and -bf16
    for dtype=bf16: each export has its own folder)."""


@dataclass
class PlanConfig:
    """`make plan`: the memory planner's assumptions. The memory figures need none of
    them; the relative step cost uses them (communication is assumed not to overlap
    compute, so the cost is pessimistic for every layout alike)."""

    chart: Optional[str] = None
    """Also draw the plan as stacked bars against the GPU's memory line (a .png path)."""
    gpu_tflops: Optional[float] = None
    """Dense bf16 peak of one GPU in TFLOP/s (null: H100 989, the device table's entry
    for the local GPU when there is one)."""
    mfu: float = 0.4
    """Fraction of peak the matmuls reach; scales compute time for every layout alike."""
    intra_node_gbps: float = 200.0
    """Collective bandwidth per GPU inside a node, GB/s (NVLink: 150-450)."""
    inter_node_gbps: float = 25.0
    """Collective bandwidth per GPU across nodes, GB/s (200 Gb/s InfiniBand = 25)."""
    pcie_gbps: float = 20.0
    """Host <-> GPU copy bandwidth for offload, GB/s (PCIe 4 x16: about 25)."""
    cpu_adam_params_per_s: float = 1.0e9
    """Parameters per second DeepSpeedCPUAdam updates on one rank's CPU cores (offload)."""
    reserve_gb: float = 2.0
    """Held back per GPU for the CUDA context, kernels' workspace and fragmentation:
    a layout fits when its total plus this is within the GPU's memory."""
    max_micro_batch: int = 1024
    """The largest micro-batch the search tries."""
    host_memory_gb: Optional[float] = None
    """Host memory of one node, GiB: a layout whose start-up needs more host memory on a
    node (offload's states, FSDP's CPU offload) is refused, like one that overflows the
    GPU. null: this machine's memory when planning for this machine (recipe=auto), else
    the column is shown and not checked."""


@dataclass
class Config:
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    run_name: Optional[str] = None
    """Name shown in W&B and the console (null: the run directory's name)."""


GROUPS = {
    "recipe": RecipeConfig,
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "precision": PrecisionConfig,
    "checkpoint": CheckpointConfig,
    "logger": LoggerConfig,
    "cluster": ClusterConfig,
    "train": TrainConfig,
    "parallel": ParallelConfig,
}


def register_configs() -> None:
    """Register the schema so `conf/config.yaml` (defaults: `- schema`) is typed."""
    cs = ConfigStore.instance()
    cs.store(name="schema", node=Config)


# ----------------------------------------------------------------------------- loading
def to_typed(cfg_node) -> Config:
    """An OmegaConf node (composed or loaded) to dataclasses with Enums."""
    merged = OmegaConf.merge(OmegaConf.structured(Config), cfg_node)
    return OmegaConf.to_object(merged)


def load_frozen(path: str | Path) -> Config:
    """The train side: read RUN_DIR/config.yaml (or a path to it)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.yaml"
    return to_typed(OmegaConf.load(p))


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)


# ----------------------------------------------------------------------------- derived
@dataclass(frozen=True)
class Parallelism:
    """What a recipe may split: data-parallel sharding, tensor parallel, pipeline."""

    shards: bool = False
    tp: bool = False
    pp: bool = False


# Recipes not listed here are pure data parallel.
RECIPE_PARALLELISM = {
    "fsdp": Parallelism(shards=True),
    "tp": Parallelism(tp=True),
    "tp_fsdp": Parallelism(shards=True, tp=True),
    "pp": Parallelism(pp=True),
}


@dataclass(frozen=True)
class Degrees:
    """The resolved degrees of one job; ranks are laid out row-major over
    (pp, dp_replicate, dp_shard, tp), the order of the device mesh's dimensions."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    def coords(self, rank: int) -> tuple[int, int, int, int]:
        """(pp, dp_replicate, dp_shard, tp) coordinates of a global rank."""
        rest, t = divmod(rank, self.tp)
        rest, s = divmod(rest, self.dp_shard)
        p, r = divmod(rest, self.dp_replicate)
        return p, r, s, t

    def dp_rank(self, rank: int) -> int:
        """Which slice of each global batch this rank's data-parallel group reads."""
        _, r, s, _ = self.coords(rank)
        return r * self.dp_shard + s


def degrees(cfg: Config, world_size: int) -> Degrees:
    """The degrees for this recipe at this world size. dp_shard=-1 takes the ranks the
    others leave; a recipe that does not shard replicates over them instead. Degrees a
    recipe does not use count as 1 (validate refuses them before a launch)."""
    p = cfg.parallel
    can = RECIPE_PARALLELISM.get(cfg.recipe.strategy.value, Parallelism())
    tp, pp = (p.tp if can.tp else 1), (p.pp if can.pp else 1)
    rest = p.dp_shard if p.dp_shard != -1 else max(1, world_size // max(1, p.dp_replicate * tp * pp))
    if can.shards:
        return Degrees(pp=pp, dp_replicate=p.dp_replicate, dp_shard=rest, tp=tp)
    return Degrees(pp=pp, dp_replicate=p.dp_replicate * rest, dp_shard=1, tp=tp)


def data_parallel_size(cfg: Config, world_size: int) -> int:
    """Ranks that see different data: world / (tp x pp)."""
    return degrees(cfg, world_size).dp


def grad_accum(cfg: Config, world_size: int) -> int:
    t = cfg.train
    if t.global_batch is None:
        return t.grad_accum
    return t.global_batch // (t.micro_batch * data_parallel_size(cfg, world_size))


def global_batch(cfg: Config, world_size: int) -> int:
    return cfg.train.micro_batch * grad_accum(cfg, world_size) * data_parallel_size(cfg, world_size)


def ffn_dim(m: ModelConfig) -> int:
    if m.ffn_dim is not None:
        return m.ffn_dim
    hidden = int(8 * m.dim / 3)
    return m.multiple_of * ((hidden + m.multiple_of - 1) // m.multiple_of)


# ----------------------------------------------------------------------------- validation
def pipeline_stages(p: ParallelConfig) -> int:
    """Pipeline stages in all: pp, times the stages per rank of an interleaved schedule."""
    return p.pp * (p.pp_virtual_stages if p.pp_schedule == PPSchedule["interleaved_1f1b"] else 1)


def nproc_per_node(cfg: Config, host) -> int:
    c = cfg.cluster
    if c.nproc_per_node is not None:
        return c.nproc_per_node
    if c.gpus_per_node is not None:
        return c.gpus_per_node
    return host.gpus if host.cuda else 2

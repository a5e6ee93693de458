"""checkpoint.*, logger.*, cluster.*, debug.*, profile.*, export.*, plan.*: what a run
keeps, where it logs, where it runs, and the tools around it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from launcher.config.enums import (
    ExportDtype,
    ExportFormat,
    FaultPoint,
    K8sKind,
    LoggerKind,
    OnExisting,
    Runner,
    Scheduler,
    WandbMode,
)


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
    RUN_DIR/archive/<its run id>/; nothing is deleted (launcher/launch/rundir/identity.py)."""
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
    system_metrics_s: float = 15.0
    """W&B's system monitor on rank 0's node samples every N seconds: per GPU its
    utilisation, memory, power and temperature (NVML), and the node's CPU, memory, disk
    and network, as W&B's system charts. It runs in W&B's own service process, not in the
    training loop. 0 turns it off. Other nodes are not sampled (training metrics stay rank
    0's alone); shorter intervals make larger run files."""


@dataclass
class K8sConfig:
    """cluster=k8s: `make submit` renders RUN_DIR/job.yaml and applies it with kubectl
    (launcher/launch/submit/k8s.py). One pod per node, each running torchrun for its node; GPUs per
    pod are cluster.gpus_per_node, the ranks' environment cluster.env, the grace after a
    stop cluster.preempt_grace_s."""

    kind: K8sKind = K8sKind.job
    image: Optional[str] = None
    """The container image every pod runs: Python with torch and the project's
    dependencies (the project's code comes from RUN_DIR/code on the shared volume, or from
    the image with cluster.snapshot_code=false). Its torch must be the submitting
    machine's version or newer: torchrun's options and the flight recorder's variables are
    chosen from that one. Required."""
    python: str = "python"
    """The interpreter in the image that runs torchrun."""
    namespace: str = "default"
    context: Optional[str] = None
    """kubectl's --context (null: the current context)."""
    volume_claim: Optional[str] = None
    """The PersistentVolumeClaim (ReadWriteMany) that holds the run directory: every pod
    writes its checkpoints there and a restarted pod resumes from them. Required."""
    mount_path: str = "/shared"
    """Where the claim is mounted in every pod. The run directory must lie under it, at the
    same path as on the machine that runs `make submit` (which mounts the same volume)."""
    node_selector: list[str] = field(default_factory=list)
    """Node labels the pods need, each key=value, e.g.
    [nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3] (a list: label keys hold dots and slashes)."""
    tolerations: list[dict] = field(default_factory=list)
    """Kubernetes tolerations, each {key, operator, value, effect, tolerationSeconds}, e.g.
    [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}] for tainted GPU nodes."""
    service_account: Optional[str] = None
    """The pods' service account (null: the namespace's default)."""
    backoff_limit: int = 3
    """Faults the job rides out before it is marked failed. A fault (a crashed rank, a
    lost node) restarts every pod's torchrun, whose ranks resume from the run directory's
    latest checkpoint; Kubernetes counts each pod's restart, so the Job's backoffLimit is
    this x cluster.nnodes. Higher rides out flaky nodes; lower stops a broken run sooner."""
    shm_gb: int = 16
    """A memory-backed /dev/shm of this size (containers get 64 MiB otherwise, too little
    for NCCL and data-loader workers). It counts against the pod's memory."""


@dataclass
class ClusterConfig:
    name: str = "local"
    runner: Runner = Runner.torchrun
    """How ranks start: torchrun (python -m torch.distributed.run), or deepspeed (DeepSpeed's
    own launcher, `deepspeed --num_nodes --num_gpus`, recipe.engine=zero only; several nodes
    are started from the first one over ssh/pdsh with a generated RUN_DIR/hostfile), or
    accelerate (`accelerate launch --config_file RUN_DIR/accelerate_config.yaml`, for those who
    start everything with it: torchrun underneath, the same ranks and losses, every recipe; one
    node, `make train` only: several nodes and Slurm/Kubernetes jobs use torchrun)."""
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
    """Threads per rank on CPU (null: the launching shell's OMP_NUM_THREADS when it is
    set, else cores / processes, at least 1)."""
    gpu_memory_gb: Optional[float] = None
    """Memory of one GPU, for the planner (null: read from nvidia-smi; required on a
    machine without GPUs when planning for one)."""
    peak_tflops: Optional[float] = None
    """Dense bf16 peak of one GPU in TFLOP/s, the denominator of MFU and the planner's step
    cost (null: the device table by the GPU's exact name, launcher/host.py; a GPU not in it
    gets a one-line warning and its measured matmul rate for MFU; H100 989 for a plan made
    on a machine without GPUs)."""
    scheduler: Scheduler = Scheduler.none
    """none: `make train` starts the ranks on this machine (several nodes: run it on each
    with nnodes, node_rank, master_addr, master_port). slurm: `make submit` renders
    RUN_DIR/job.sbatch and hands it to sbatch. k8s: `make submit` renders RUN_DIR/job.yaml
    (cluster.k8s.*) and applies it. `make train` refuses a slurm or k8s config."""
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
    k8s: K8sConfig = field(default_factory=K8sConfig)
    """scheduler: k8s: the Kubernetes fields (K8sConfig)."""
    snapshot_code: bool = True
    """`make submit` copies the project's code (launcher/, engines/) into RUN_DIR/code and
    the job imports it from there (PYTHONPATH, with PYTHONSAFEPATH so the working directory
    does not win; Python 3.11+; cluster.env.PYTHONPATH follows it, the submitting shell's is
    not used): a job requeued days later, or resubmitted by hand, runs the code it was
    submitted with, whatever the checkout holds by then. false: the job imports
    whatever the checkout holds when it starts (edits between submit and start, or between
    requeues, change a running experiment)."""


@dataclass
class DebugConfig:
    """Fault injection for the reliability tests: a real SIGKILL or a real sleep at a
    named point, on one rank, at one step. Off (null) in every real run."""

    fault: Optional[FaultPoint] = None
    fault_step: int = 1
    """The step at (or during whose checkpoint save) the fault strikes."""
    fault_rank: int = 0
    """The global rank it strikes."""
    fault_steps: int = 1
    """nan_loss, spike, slow: the steps in a row it strikes, from fault_step."""
    slow_s: float = 0.2
    """slow: the seconds each forward of the rank takes longer."""
    async_save_delay_s: float = 0.0
    """checkpoint.async_save: each rank's writer thread waits this long before it writes,
    while training goes on (a staged copy that still shared the live tensors would then be
    written changed; tests)."""
    startup_digest: bool = False
    """Add summary.json's startup.weights_digest: sha256 of the consolidated fp32 weights
    when the engine is ready (step 0), equal at every layout for one train.seed. Gathers the
    whole model on every rank: for tests and small models only."""
    final_digest: bool = False
    """Add summary.json's weights_digest_per_rank: sha256 of each rank's own weights after
    the last step. Every rank copies and hashes all it holds (seconds per GB, at the end of
    the run): for tests that compare runs bit for bit."""


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
    for dtype=bf16: each export has its own folder). Read from `launcher export`'s command
    line only: a run directory's config.yaml (a copied one) never chooses where it writes."""
    merge_lora: bool = False
    """A LoRA run (model.lora.rank > 0): false exports the adapters alone as a PEFT folder
    (adapter_config.json, adapter_model.safetensors: megabytes, loaded over the base with
    peft.PeftModel.from_pretrained; model=hf, export.format=hf); true merges them into the
    base weights read from model.pretrained (W + alpha/r x B A) and exports the whole model
    as format says, with nothing of PEFT needed to load it."""


@dataclass
class PlanConfig:
    """`make plan`: the memory planner's assumptions. The memory figures need none of
    them; the relative step cost uses them (communication is assumed not to overlap
    compute, so the cost is pessimistic for every layout alike)."""

    chart: Optional[str] = None
    """Also draw the plan as stacked bars against the GPU's memory line (a .png path)."""
    mfu: float = 0.4
    """Fraction of peak the matmuls reach; scales compute time for every layout alike."""
    intra_node_gbps: float = 200.0
    """Collective bandwidth per GPU inside a node, GB/s (NVLink: 150-450)."""
    inter_node_gbps: float = 25.0
    """Collective bandwidth per GPU across nodes, GB/s (200 Gb/s InfiniBand = 25)."""
    collective_latency_us: float = 20.0
    """Start-up time of one collective (NCCL: about 10-20 us in a node, 20-50 across nodes):
    what makes many small buckets slower than a few big ones at the same bytes."""
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

"""Cross-field checks on the launch side, before anything is written or started: what no
single type of launcher/config/ can express (batch arithmetic, device capabilities,
paths, parallel degrees against the model's shape, Slurm's and DeepSpeed's settings).
Each raises `ConfigError`, which the launch side prints as one line, exit 2.
`validate(cfg, host)` runs them all; the model's own files (model=hf: transformers,
offline) and the tokenizer (data=hf_text) are read only when configured.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import engines
from launcher import optim
from launcher.config import (
    Backend,
    Config,
    ConfigError,
    DataKind,
    ModelConfig,
    ModelKind,
    OffloadDevice,
    PPSchedule,
    Precision,
    Runner,
    Scheduler,
    TokenDtype,
    ffn_dim,
    nproc_per_node,
    pipeline_stages,
)
from launcher.launch.checks.data import validate_evaluation, validate_token_data
from launcher.launch.checks.levers import validate_context_parallel, validate_levers
from launcher.models import model_shape, model_vocab_size
from launcher.models.hf_adapter import check
from launcher.parallel.degrees import data_parallel_size, grad_accum

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# What sbatch accepts (checked here so a typo fails before anything is written).
_SLURM_NAME = re.compile(r"[A-Za-z0-9_.,:+@-]+")
_SLURM_TIME = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}|UNLIMITED|INFINITE")
_SLURM_MEM = re.compile(r"\d+[KMGT]?")
_SLURM_CONSTRAINT = re.compile(r"[A-Za-z0-9_.,:+@&|*!()\[\]-]+")


def _positive(key: str, value, *, zero_ok: bool = False) -> None:
    low = 0 if zero_ok else 1
    if value is None or value < low:
        raise ConfigError(key, value, f"must be >= {low}")


def validate(cfg: Config, host) -> list[str]:
    """Cross-field checks on the launch side, in this order (the first failure is the line
    the user sees). `host` is a host.HostInfo. Returns notes (a value it adjusted): the
    caller prints them once every check has passed, so bad input stays one line."""
    validate_train(cfg)
    if cfg.model.kind == ModelKind.hf:
        validate_hf_model(cfg)
    else:
        validate_gpt_model(cfg)
    validate_data(cfg)
    notes = validate_optimizer(cfg, host)
    validate_device(cfg, host)
    validate_outputs(cfg)
    validate_cluster(cfg, host)
    validate_zero(cfg, host)
    validate_batch(cfg, host)
    return notes


def validate_train(cfg: Config) -> None:
    """train.* ranges and the debug knobs' (the model and data keys have their own)."""
    t = cfg.train
    for key in ("steps", "micro_batch", "grad_accum", "seq_len", "ac_every"):
        _positive(f"train.{key}", getattr(t, key))
    if t.global_batch is not None:
        _positive("train.global_batch", t.global_batch)
    if t.stop_at is not None and not 1 <= t.stop_at <= t.steps:
        raise ConfigError("train.stop_at", t.stop_at, f"must be in [1, train.steps={t.steps}] (or null)")
    if t.max_bad_steps < 0:
        raise ConfigError("train.max_bad_steps", t.max_bad_steps, "must be >= 0 (0: the loss guard off)")
    if t.spike_factor and not (t.spike_factor > 1 and t.max_bad_steps):
        raise ConfigError(
            "train.spike_factor",
            t.spike_factor,
            "must be 0 (off) or > 1, with the loss guard on (train.max_bad_steps >= 1)",
        )
    if t.straggler_factor and not t.straggler_factor > 1:
        raise ConfigError("train.straggler_factor", t.straggler_factor, "must be 0 (off) or > 1")
    _positive("debug.fault_steps", cfg.debug.fault_steps)
    if not cfg.debug.slow_s >= 0:
        raise ConfigError("debug.slow_s", cfg.debug.slow_s, "must be >= 0")


def validate_data(cfg: Config) -> None:
    """data.*: against the model's vocabulary, each source's own keys (a tokenizer is read
    only for data=hf_text and chat)."""
    d = cfg.data
    _positive("data.vocab_size", d.vocab_size)
    if d.vocab_size > model_vocab_size(cfg) and d.name not in (
        DataKind.hf_text,
        DataKind.chat,
    ):  # the tokenizer's, below
        raise ConfigError("data.vocab_size", d.vocab_size, f"must be <= model.vocab_size={model_vocab_size(cfg)}")
    if d.name == DataKind.synthetic:
        _positive("data.order", d.order)
        if not 0 <= d.context_bits <= 8:
            raise ConfigError("data.context_bits", d.context_bits, "must be in [0, 8]")
        states = d.vocab_size * 2 ** (d.context_bits * (d.order - 1))
        if states > 2**20:
            raise ConfigError(
                "data.order", d.order, f"vocab_size x 2^(context_bits x (order-1)) = {states} contexts; at most 2^20"
            )
        if not d.temperature > 0:
            raise ConfigError("data.temperature", d.temperature, "must be > 0")
        if d.vocab_size < 2:
            raise ConfigError("data.vocab_size", d.vocab_size, "synthetic data needs >= 2 tokens")
    elif d.name == DataKind.memmap:
        validate_token_data(cfg)
        if d.dtype == TokenDtype.uint16 and d.vocab_size > 65536:
            raise ConfigError("data.vocab_size", d.vocab_size, "uint16 tokens allow at most 65536")
    elif d.name == DataKind.hf_text:
        from launcher.data.prepare import validate_hf_text  # local: start-up (numpy, 0.75 s, launch side)

        validate_hf_text(cfg)
    elif d.name == DataKind.chat:
        from launcher.data.prepare import validate_chat  # local: start-up (numpy, 0.75 s, launch side)

        validate_chat(cfg)
    if d.document_masking and d.name not in (DataKind.chat, DataKind.hf_text):
        raise ConfigError(
            "data.document_masking",
            True,
            f"data={d.name.value} has no sample boundaries to mask at; "
            "data=chat (its samples) and data=hf_text (its documents) have",
        )
    if d.num_workers is not None and d.num_workers < 0:
        raise ConfigError("data.num_workers", d.num_workers, "must be >= 0 (or null for auto)")
    _positive("data.prefetch_factor", d.prefetch_factor)


def validate_optimizer(cfg: Config, host) -> list[str]:
    """optim.* against the recipe and the machine; warmup clamped to a short run (a note)."""
    notes: list[str] = []
    t, o = cfg.train, cfg.optim
    spec = engines.spec(cfg.recipe.engine)
    optim.validate(
        o, cfg.recipe.name, spec.deepspeed, spec.parallelism.shards and cfg.recipe.fsdp.cpu_offload, host.cuda
    )
    if o.warmup_steps < 0:
        raise ConfigError("optim.warmup_steps", o.warmup_steps, "must be >= 0")
    if o.warmup_steps > t.steps:  # as torchtitan does: a short run (a smoke test) warms up throughout
        notes.append(
            f"optim.warmup_steps={o.warmup_steps} is longer than train.steps={t.steps}: warming up over "
            f"all {t.steps} steps"
        )
        o.warmup_steps = t.steps
    return notes


def validate_device(cfg: Config, host) -> None:
    """Precision, backend and the collectives' timeouts against the machine."""
    if cfg.precision.name == Precision.fp16 and not host.cuda:
        raise ConfigError(
            "precision", "fp16", "fp16 needs CUDA (loss scaling on GPU); this machine has none: use bf16 or fp32"
        )
    if cfg.dist.backend == Backend.nccl and not host.cuda:
        raise ConfigError("dist.backend", "nccl", "nccl needs CUDA GPUs; this machine has none: use auto or gloo")
    _positive("dist.timeout_s", cfg.dist.timeout_s)
    _positive("dist.flight_recorder", cfg.dist.flight_recorder, zero_ok=True)


def validate_outputs(cfg: Config) -> None:
    """What the run writes: checkpoints (and the one it resumes), logs, a profile."""
    _positive("checkpoint.every", cfg.checkpoint.every, zero_ok=True)
    _positive("checkpoint.keep", cfg.checkpoint.keep)
    r = cfg.checkpoint.resume
    if r not in ("auto", "never") and not Path(r).is_dir():
        raise ConfigError("checkpoint.resume", r, "allowed: auto, never, or an existing checkpoint folder")
    _positive("logger.log_every", cfg.logger.log_every)
    if cfg.profile.enabled:
        steps = list(cfg.profile.steps)
        if len(steps) != 2 or not 1 <= steps[0] <= steps[1] <= cfg.train.steps:
            raise ConfigError(
                "profile.steps", steps, f"[first, last] with 1 <= first <= last <= train.steps={cfg.train.steps}"
            )
    _positive("debug.async_save_delay_s", cfg.debug.async_save_delay_s, zero_ok=True)


def validate_cluster(cfg: Config, host) -> None:
    """cluster.*: nodes, ports, timeouts, environment names, Slurm's keys, the processes
    per node against the machine's GPUs or cores."""
    c = cfg.cluster
    _positive("cluster.nnodes", c.nnodes)
    if not 0 <= c.node_rank < c.nnodes:
        raise ConfigError("cluster.node_rank", c.node_rank, f"must be in [0, cluster.nnodes={c.nnodes})")
    _positive("cluster.max_restarts", c.max_restarts, zero_ok=True)
    _positive("cluster.shutdown_timeout_s", c.shutdown_timeout_s)
    if c.master_port is not None and not 1 <= c.master_port <= 65535:
        raise ConfigError("cluster.master_port", c.master_port, "must be a port in 1..65535")
    if c.nnodes > 1 and c.master_port is None and c.scheduler == Scheduler.none:
        raise ConfigError("cluster.master_port", None, "a multi-node run needs the same explicit port on every node")
    if c.cpu_threads is not None:
        _positive("cluster.cpu_threads", c.cpu_threads)
    if c.join_timeout_s is not None:
        _positive("cluster.join_timeout_s", c.join_timeout_s)
    _positive("cluster.rdzv_timeout_s", c.rdzv_timeout_s)
    if c.peak_tflops is not None and not c.peak_tflops > 0:
        raise ConfigError("cluster.peak_tflops", c.peak_tflops, "must be > 0 (TFLOP/s), or null for the device table")
    for name in c.env:
        if not _ENV_NAME.fullmatch(name):
            raise ConfigError(f"cluster.env.{name}", c.env[name], "environment variable names are letters, digits, _")
    if c.scheduler == Scheduler.slurm:
        validate_slurm(cfg)
    slots = c.gpus_per_node if c.gpus_per_node is not None else host.slots
    if c.gpus_per_node is not None:
        _positive("cluster.gpus_per_node", c.gpus_per_node)
        if host.cuda and c.gpus_per_node > host.gpus:
            raise ConfigError("cluster.gpus_per_node", c.gpus_per_node, f"this machine has {host.gpus} GPU(s)")
    if c.nproc_per_node is not None:
        if not 1 <= c.nproc_per_node <= slots:
            where = f"{host.gpus} GPU(s)" if host.cuda else f"a CPU-only machine ({host.cpus} cores)"
            raise ConfigError("cluster.nproc_per_node", c.nproc_per_node, f"allowed 1..{slots} on {where}")


def validate_batch(cfg: Config, host) -> None:
    """The batch arithmetic over the world size: degrees, levers, the global batch, the
    pipeline's micro-batches, the evaluation's samples."""
    t, c = cfg.train, cfg.cluster
    world = nproc_per_node(cfg, host) * c.nnodes
    validate_parallel(cfg, world)
    validate_levers(cfg, host, world)
    dp = data_parallel_size(cfg, world)
    if t.global_batch is not None and t.global_batch % (t.micro_batch * dp):
        raise ConfigError(
            "train.global_batch",
            t.global_batch,
            f"must be a multiple of micro_batch({t.micro_batch}) x data-parallel size({dp}) = {t.micro_batch * dp}",
        )
    validate_pipeline_batch(cfg, world)
    validate_evaluation(cfg, dp, grad_accum(cfg, world))


def validate_gpt_model(cfg: Config) -> None:
    """The project's decoder: its shape fields."""
    t, m = cfg.train, cfg.model
    for key in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len", "multiple_of"):
        _positive(f"model.{key}", getattr(m, key))
    if m.head_dim is not None and (m.head_dim < 2 or m.head_dim % 2):
        raise ConfigError(
            "model.head_dim", m.head_dim, "must be even and >= 2 for rotary embeddings, or null (dim / n_heads)"
        )
    if m.head_dim is None and m.dim % m.n_heads:
        raise ConfigError("model.n_heads", m.n_heads, f"must divide model.dim={m.dim} (or set model.head_dim)")
    if m.head_dim is None and (m.dim // m.n_heads) % 2:
        raise ConfigError(
            "model.n_heads",
            m.n_heads,
            f"head_dim = dim/n_heads = {m.dim // m.n_heads} must be even for rotary embeddings",
        )
    if m.n_kv_heads is not None and (m.n_kv_heads < 1 or m.n_heads % m.n_kv_heads):
        raise ConfigError("model.n_kv_heads", m.n_kv_heads, f"must be >= 1 and divide model.n_heads={m.n_heads}")
    if m.ffn_dim is not None:
        _positive("model.ffn_dim", m.ffn_dim)
    if t.seq_len > m.max_seq_len:
        raise ConfigError("train.seq_len", t.seq_len, f"must be <= model.max_seq_len={m.max_seq_len}")
    if m.pretrained is not None:  # a Hugging Face folder read into the decoder: its shape and tensors
        check(cfg)


def validate_hf_model(cfg: Config) -> None:
    """model=hf: the files exist, transformers builds the model offline, its shape fits the
    sequence length and the parallel degrees (launcher/models/hf.py; imports transformers)."""
    from launcher.models.hf import check  # local: torch (launch side)

    check(cfg)


def validate_parallel(cfg: Config, world: int) -> None:
    """Degrees against the recipe, the model and the world size (numbers in every message)."""
    p, m = cfg.parallel, model_shape(cfg)
    validate_degrees(cfg, m)
    if p.tp > 1:
        validate_tp_split(cfg, m)
    if p.pp > 1:
        validate_pp_split(p, m)
    validate_world(cfg, world)


def validate_degrees(cfg: Config, m: ModelConfig) -> None:
    """Each degree positive and one the recipe's engine has (engines.spec(...).parallelism)."""
    p, name = cfg.parallel, cfg.recipe.engine
    spec = engines.spec(name)
    can = spec.parallelism
    for key in ("dp_replicate", "tp", "cp", "pp", "pp_microbatches", "pp_virtual_stages"):
        _positive(f"parallel.{key}", getattr(p, key))
    if p.dp_shard != -1 and p.dp_shard < 1:
        raise ConfigError("parallel.dp_shard", p.dp_shard, "must be >= 1, or -1 for the ranks the other degrees leave")
    if p.tp > 1 and not can.tp:
        raise ConfigError("parallel.tp", p.tp, f"recipe {name} has no tensor parallel; use recipe=tp or recipe=tp_fsdp")
    if p.pp > 1 and not can.pp:
        raise ConfigError(
            "parallel.pp", p.pp, f"recipe {name} has no pipeline parallel; use recipe=pp or recipe=pp_fsdp"
        )
    if p.dp_shard > 1 and not can.shards:
        raise ConfigError(
            "parallel.dp_shard",
            p.dp_shard,
            f"recipe {name} does not shard; use recipe=fsdp or recipe=tp_fsdp, or parallel.dp_replicate",
        )
    if "tp" in can.required and p.tp < 2:
        raise ConfigError("parallel.tp", p.tp, f"recipe {name} needs tp >= 2 (tp=1 is plain data parallel)")
    if "pp" in can.required and p.pp < 2:
        raise ConfigError("parallel.pp", p.pp, f"recipe {name} needs pp >= 2 (pp=1 is plain data parallel)")
    if can.pp and can.shards and p.dp_replicate > 1:
        raise ConfigError(
            "parallel.dp_replicate",
            p.dp_replicate,
            f"recipe {name} shards each stage over all its data-parallel ranks (FSDP); HSDP under a "
            f"pipeline is not built: use dp_replicate=1, or recipe=pp for replicated stages",
        )
    if can.pp and can.shards and cfg.recipe.fsdp.cpu_offload:
        raise ConfigError(
            "recipe.fsdp.cpu_offload",
            "true",
            f"recipe {name} keeps each stage's gradients unsharded on the device through the step; "
            f"offload is for recipe=fsdp or tp_fsdp",
        )
    if not spec.fp16 and cfg.precision.name == Precision.fp16:
        raise ConfigError("precision", "fp16", f"recipe {name} supports bf16 and fp32 (it has no fp16 loss scaler)")
    if p.cp > 1:
        validate_context_parallel(cfg, m, name, can.cp)


def validate_tp_split(cfg: Config, m: ModelConfig) -> None:
    """Tensor parallel: every split dimension divides; no q/k norms or biases to split."""
    p = cfg.parallel
    kv = m.n_kv_heads or m.n_heads
    if (m.qk_norm or m.attn_bias) and not m.moe.experts:  # an MoE: refused under tp by levers.validate_moe
        key = "model.qk_norm" if m.qk_norm else "model.attn_bias"
        raise ConfigError(
            key,
            "true",
            f"tensor parallel (parallel.tp={p.tp}) does not split the attention's "
            "q/k norms or biases; use parallel.tp=1 (fsdp, zero, ddp)",
        )
    for key, size in (
        ("model.n_heads", m.n_heads),
        ("model.n_kv_heads", kv),
        ("model.ffn_dim (SwiGLU hidden)", ffn_dim(m)),
    ):
        if size % p.tp:
            raise ConfigError("parallel.tp", p.tp, f"must divide {key}={size}")
    if not m.tie_embeddings and m.vocab_size % p.tp:
        raise ConfigError(
            "parallel.tp",
            p.tp,
            f"must divide model.vocab_size={m.vocab_size} (untied embeddings are split by vocabulary)",
        )
    if p.sequence_parallel and cfg.train.seq_len % p.tp:
        raise ConfigError(
            "parallel.sequence_parallel",
            "true",
            f"needs train.seq_len={cfg.train.seq_len} divisible by parallel.tp={p.tp}",
        )


def validate_pp_split(p, m: ModelConfig) -> None:
    """Pipeline: the stages fit the layers, an explicit split is increasing and inside."""
    stages = pipeline_stages(p)
    if stages > m.n_layers:
        raise ConfigError(
            "parallel.pp",
            p.pp,
            f"{stages} stages (pp {p.pp} x {stages // p.pp} per rank) "
            f"but model.n_layers={m.n_layers}; every stage needs a layer",
        )
    if p.pp_split is not None:
        split = list(p.pp_split)
        if len(split) != stages - 1 or split != sorted(set(split)) or not all(0 < s < m.n_layers for s in split):
            which = "stage 2" if stages == 2 else f"stages 2..{stages}"
            raise ConfigError(
                "parallel.pp_split",
                split,
                f"needs {stages - 1} increasing layer index(es) in "
                f"[1, {m.n_layers - 1}] (the first layer of {which}); null balances by parameters",
            )


def validate_world(cfg: Config, world: int) -> None:
    """The degrees multiply to the world size (dp_shard=-1: whatever the others leave)."""
    p = cfg.parallel
    fixed = p.dp_replicate * p.tp * p.pp * p.cp
    shard = p.dp_shard if p.dp_shard != -1 else world // fixed
    if shard < 1 or fixed * shard != world:
        key, value = next(
            (
                (f"parallel.{k}", getattr(p, k))
                for k in ("tp", "cp", "pp", "dp_shard", "dp_replicate")
                if getattr(p, k) not in (1, -1)
            ),
            ("parallel", "default"),
        )
        world_is = f"world size {world} (cluster.nproc_per_node x cluster.nnodes = {world // cfg.cluster.nnodes} x {cfg.cluster.nnodes})"
        cp = f"cp({p.cp}) x " if p.cp > 1 else ""
        if p.dp_shard == -1:
            raise ConfigError(
                key,
                value,
                f"{world_is} is not a multiple of dp_replicate({p.dp_replicate}) x "
                f"{cp}tp({p.tp}) x pp({p.pp}) = {fixed}",
            )
        raise ConfigError(
            key,
            value,
            f"{world_is} is not dp_replicate({p.dp_replicate}) x dp_shard({p.dp_shard}) x "
            f"{cp}tp({p.tp}) x pp({p.pp}) = {fixed * p.dp_shard}",
        )


def validate_pipeline_batch(cfg: Config, world: int) -> None:
    """The pipeline cuts each data-parallel rank's batch into pp_microbatches equal parts."""
    p = cfg.parallel
    if p.pp < 2:
        return
    batch = cfg.train.micro_batch * grad_accum(cfg, world)
    n = p.pp_microbatches
    if batch % n:
        raise ConfigError(
            "parallel.pp_microbatches",
            n,
            f"must divide the batch of each data-parallel rank: "
            f"micro_batch({cfg.train.micro_batch}) x grad_accum({grad_accum(cfg, world)}) = {batch}",
        )
    if p.pp_schedule == PPSchedule["1f1b"] and n < p.pp:
        raise ConfigError("parallel.pp_microbatches", n, f"1f1b needs at least pp={p.pp} micro-batches")
    rounds = max(1, n // p.pp)
    if p.pp_schedule == PPSchedule["interleaved_1f1b"] and n % rounds:
        raise ConfigError(
            "parallel.pp_microbatches",
            n,
            f"interleaved_1f1b needs a multiple of max(1, pp_microbatches // pp) = {rounds}",
        )


def validate_slurm(cfg: Config) -> None:
    """The Slurm fields: values sbatch will accept, a warning that covers the save."""
    c = cfg.cluster
    for key in ("partition", "account", "qos"):
        value = getattr(c, key)
        if value is not None and not _SLURM_NAME.fullmatch(value):
            raise ConfigError(f"cluster.{key}", value, "letters, digits and _.,:+@- only (a Slurm name)")
    if c.time is not None and not _SLURM_TIME.fullmatch(c.time):
        raise ConfigError(
            "cluster.time", c.time, "allowed: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, UNLIMITED (or null)"
        )
    if c.mem is not None and not _SLURM_MEM.fullmatch(c.mem):
        raise ConfigError("cluster.mem", c.mem, "a number with an optional K/M/G/T suffix, e.g. 200G (0 = all)")
    if c.constraint is not None and not _SLURM_CONSTRAINT.fullmatch(c.constraint):
        raise ConfigError("cluster.constraint", c.constraint, "node features joined by & | , e.g. a100|h100")
    if c.cpus_per_task is not None:
        _positive("cluster.cpus_per_task", c.cpus_per_task)
    for line in c.sbatch_extra:
        if not line.startswith("-") or "\n" in line or "\r" in line:
            raise ConfigError(
                "cluster.sbatch_extra", line, "each entry is one sbatch option on one line, e.g. --gres=gpu:8"
            )
    if not 1 <= c.preempt_grace_s <= 65535:
        raise ConfigError("cluster.preempt_grace_s", c.preempt_grace_s, "must be in 1..65535 seconds")
    if c.preempt_grace_s < c.shutdown_timeout_s:
        raise ConfigError(
            "cluster.preempt_grace_s",
            c.preempt_grace_s,
            f"must be >= cluster.shutdown_timeout_s={c.shutdown_timeout_s} (the ranks' save must fit in the warning)",
        )
    _positive("cluster.max_requeues", c.max_requeues, zero_ok=True)
    if c.local_addr is not None:
        raise ConfigError(
            "cluster.local_addr",
            c.local_addr,
            "one address for every node of a Slurm job cannot be right: leave it null (each node's name)",
        )
    if c.requeue and cfg.checkpoint.resume != "auto":
        raise ConfigError(
            "checkpoint.resume",
            cfg.checkpoint.resume,
            "a requeued job must resume from its own latest checkpoint: use auto (or cluster.requeue=false)",
        )


def validate_deepspeed_nodes(c) -> None:
    """cluster.runner=deepspeed over several nodes: every host named, started from node 0."""
    if c.runner == Runner.deepspeed and c.nnodes > 1:
        if len(c.hosts) != c.nnodes:
            raise ConfigError(
                "cluster.hosts",
                list(c.hosts),
                f"runner=deepspeed with cluster.nnodes={c.nnodes} needs {c.nnodes} hostnames "
                "(the first runs the launcher and starts the others over ssh)",
            )
        if c.node_rank != 0:
            raise ConfigError(
                "cluster.node_rank",
                c.node_rank,
                "runner=deepspeed starts every node from the first one: launch once, with node_rank=0",
            )
        for h in c.hosts:
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", h):
                raise ConfigError("cluster.hosts", h, "a hostname or address (letters, digits, '.', '_', '-')")


def validate_zero(cfg: Config, host) -> None:
    """ZeRO options, offload and the deepspeed runner: what combinations make sense."""
    z, c, engine = cfg.recipe.zero, cfg.cluster, cfg.recipe.engine
    deepspeed = engines.spec(engine).deepspeed
    if c.runner == Runner.deepspeed and not deepspeed:
        raise ConfigError(
            "cluster.runner",
            "deepspeed",
            f"DeepSpeed's launcher is for recipe.engine=zero; recipe {cfg.recipe.name} "
            f"(engine {engine}) does not use DeepSpeed: use cluster.runner=torchrun",
        )
    if not deepspeed:
        for key in ("offload_optimizer", "offload_param"):
            if getattr(z, key) != OffloadDevice.none:
                raise ConfigError(
                    f"recipe.zero.{key}",
                    getattr(z, key).value,
                    f"recipe {cfg.recipe.name} (engine {engine}) cannot offload; "
                    "offload needs a ZeRO recipe (zero2_offload, zero3_offload)",
                )
        return
    if not 0 <= z.stage <= 3:
        raise ConfigError("recipe.zero.stage", z.stage, "allowed: 0, 1, 2, 3")
    if cfg.train.max_bad_steps and z.stage == 0:
        raise ConfigError(
            "train.max_bad_steps",
            cfg.train.max_bad_steps,
            "the loss guard needs recipe.zero.stage "
            "1, 2 or 3 (stage 0's plain optimizer applies a non-finite step), or recipe=ddp",
        )
    if z.offload_optimizer != OffloadDevice.none and z.stage == 0:
        raise ConfigError(
            "recipe.zero.offload_optimizer",
            z.offload_optimizer.value,
            "optimizer offload needs recipe.zero.stage 1, 2 or 3",
        )
    if z.offload_param != OffloadDevice.none and z.stage != 3:
        raise ConfigError(
            "recipe.zero.offload_param",
            z.offload_param.value,
            f"parameter offload needs recipe.zero.stage=3 (this is stage {z.stage})",
        )
    for key in ("reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size"):
        if getattr(z, key) is not None:
            _positive(f"recipe.zero.{key}", getattr(z, key))
    if z.param_persistence_threshold is not None:
        _positive("recipe.zero.param_persistence_threshold", z.param_persistence_threshold, zero_ok=True)
    _positive("recipe.zero.max_live_parameters", z.max_live_parameters)
    _positive("recipe.zero.max_reuse_distance", z.max_reuse_distance, zero_ok=True)
    p = cfg.precision
    if p.name == Precision.fp16 and (p.initial_scale < 1 or math.log2(p.initial_scale) % 1):
        raise ConfigError(
            "precision.initial_scale",
            p.initial_scale,
            "DeepSpeed's loss scale starts at a power of two (2^initial_scale_power)",
        )
    validate_deepspeed_nodes(c)

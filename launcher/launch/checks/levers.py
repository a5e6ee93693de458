"""Launch-side checks of the memory and speed levers (each one line, exit 2, before any
rank): the loss in slices (train.loss_chunks), activation offload, float8 matmuls
(precision=fp8) and context parallel (parallel.cp), each against the recipe, the model and the machine it is asked with."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import engines
from launcher import models
from launcher.config import Config, ConfigError, ModelKind, Precision, sliceable_loss
from launcher.host import fp8_capable, gpu_name
from launcher.parallel.degrees import degrees


def validate_levers(cfg: Config, host, world: int = 1) -> None:
    p, t, name = cfg.parallel, cfg.train, cfg.recipe.engine
    chunks = t.loss_chunks
    if chunks is not None and not 1 <= chunks <= t.seq_len:
        raise ConfigError("train.loss_chunks", chunks, f"must be in 1..train.seq_len={t.seq_len}, or null (auto)")
    if chunks is not None and chunks > 1 and not sliceable_loss(cfg, p.pp, p.tp):
        why = (
            "model=hf computes its loss whole (slices: the project's decoder)"
            if cfg.model.kind == ModelKind.hf
            else f"recipe {name}: a pipeline's last stage computes the loss whole"
            if p.pp > 1
            else f"parallel.tp={p.tp} splits the head by vocabulary (its logits are gathered whole)"
        )
        raise ConfigError("train.loss_chunks", chunks, f"{why}; use 1 or null (auto)")

    if t.activation_offload:  # the blocks' saved tensors, through launcher/models/offload.py
        why = (
            "model=hf runs its own blocks"
            if cfg.model.kind == ModelKind.hf
            else f"parallel.tp={p.tp} saves DTensors"
            if p.tp > 1
            else "train.compile=true traces the blocks"
            if t.compile
            else None
        )
        if why:
            raise ConfigError(
                "train.activation_offload",
                True,
                f"{why}; allowed with the project's decoder (model=gpt_*), parallel.tp=1 and train.compile=false",
            )

    if cfg.precision.fp8:
        validate_fp8(cfg, host)
    if cfg.model.lora.rank != 0:
        validate_lora(cfg)
    if cfg.model.moe.experts or p.ep != 1:
        validate_moe(cfg, world)


def validate_moe(cfg: Config, world: int = 1) -> None:
    """model.moe (launcher/models/moe.py) and parallel.ep: the router's numbers, the recipes
    that take an MoE (no tensor or pipeline parallel: the experts are not split by tp, and a
    pipeline's auxiliary losses would be on other stages), and ep against the experts."""
    e, m, p, name = cfg.model.moe, cfg.model, cfg.parallel, cfg.recipe.engine
    if p.ep < 1:
        raise ConfigError("parallel.ep", p.ep, "must be >= 1 (1: every rank holds every expert)")
    if not e.experts:
        raise ConfigError(
            "parallel.ep", p.ep, "expert parallel needs an MoE model (model.moe.experts > 0, e.g. model=moe_tiny)"
        )
    if m.kind == ModelKind.hf:
        raise ConfigError(
            "model.moe.experts",
            e.experts,
            "model.moe shapes the project's decoder; model=hf takes its shape from the Hugging Face config",
        )
    if e.experts < 2 or not 1 <= e.top_k <= e.experts:
        raise ConfigError(
            "model.moe.top_k" if e.experts >= 2 else "model.moe.experts",
            e.top_k if e.experts >= 2 else e.experts,
            f"needs experts >= 2 and 1 <= top_k <= experts={e.experts}",
        )
    for key in ("expert_dim", "shared_dim", "capacity_factor"):
        value = getattr(e, key)
        if value is not None and value <= 0:
            raise ConfigError(f"model.moe.{key}", value, "must be > 0, or null")
    if e.shared_experts < 0 or not 0 <= e.first_dense <= m.n_layers:
        key, value = ("shared_experts", e.shared_experts) if e.shared_experts < 0 else ("first_dense", e.first_dense)
        raise ConfigError(
            f"model.moe.{key}", value, f"allowed: shared_experts >= 0, first_dense in 0..model.n_layers={m.n_layers}"
        )
    if e.shared_gate and not e.shared_experts:
        raise ConfigError(
            "model.moe.shared_gate", "true", "gates the shared expert: needs model.moe.shared_experts >= 1"
        )
    if p.tp > 1 or p.pp > 1:
        key, value = ("parallel.tp", p.tp) if p.tp > 1 else ("parallel.pp", p.pp)
        dense = ", ".join(n for n in engines.names() if not engines.spec(n).parallelism.required)
        raise ConfigError(
            key,
            value,
            f"an MoE model (model.moe.experts={e.experts}) runs under the engines {dense} "
            "(recipe=ddp, fsdp, zero1..zero3_offload), with parallel.ep for its experts",
        )
    if p.ep > 1:
        able = [n for n in engines.names() if engines.spec(n).parallelism.ep]
        if not engines.spec(name).parallelism.ep:
            raise ConfigError(
                "parallel.ep",
                p.ep,
                f"recipe {cfg.recipe.name} has no expert parallel; "
                f"{'use recipe=' + ' or recipe='.join(able) if able else 'no recipe has one yet'}",
            )
        if e.experts % p.ep:
            raise ConfigError("parallel.ep", p.ep, f"must divide model.moe.experts={e.experts}")
        validate_ep_ranks(cfg, world)


def validate_ep_ranks(cfg: Config, world: int) -> None:
    """ep > 1 splits the experts over ep of the ranks that share the dense weights' data
    parallel: fsdp's dp_shard x cp (not across HSDP's replicas), ddp's whole world."""
    p, deg = cfg.parallel, degrees(cfg, world)
    if engines.spec(cfg.recipe.engine).parallelism.shards:
        if p.dp_replicate > 1:
            raise ConfigError(
                "parallel.ep",
                p.ep,
                f"not with parallel.dp_replicate={p.dp_replicate} (HSDP) yet: the "
                "experts split over the dp_shard x cp ranks; use dp_replicate=1",
            )
        ranks, what = deg.dp_shard * deg.cp, f"the FSDP ranks dp_shard x cp = {deg.dp_shard} x {deg.cp}"
    else:
        ranks, what = world, f"the world size {world}"
    if ranks % p.ep:
        raise ConfigError("parallel.ep", p.ep, f"must divide {what} = {ranks} (ep of them split the experts)")
    if cfg.precision.name == Precision.fp16:  # each rank's scaler would skip on its own experts' overflow
        raise ConfigError(
            "parallel.ep",
            p.ep,
            "not with precision=fp16: the loss scaler's overflow check is per rank "
            "and the experts' gradients differ between ranks; use precision=bf16",
        )


def validate_fp8(cfg: Config, host) -> None:
    """precision=fp8: torchao installed, bf16 around it, ddp or fsdp without tensor or
    pipeline parallel, and float8 tensor cores (or precision.fp8_emulate=true)."""
    p = cfg.parallel
    if cfg.precision.name != Precision.bf16:
        raise ConfigError(
            "precision",
            "fp8",
            f"runs inside bf16 autocast; precision.name={cfg.precision.name.value} "
            "(use precision=fp8, which sets both)",
        )
    if not engines.spec(cfg.recipe.engine).fp8 or p.tp > 1 or p.pp > 1:
        fp8 = [name for name, spec in engines.specs().items() if spec.fp8]  # EngineSpec.fp8
        raise ConfigError(
            "precision",
            "fp8",
            f"recipe {cfg.recipe.name} (tp {p.tp}, pp {p.pp}): float8 linear layers run "
            f"under {' and '.join(fp8)} (recipe={' or '.join(fp8)}, tp 1, pp 1)",
        )
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(
            "precision",
            "fp8",
            "needs torchao, the fp8 extra (.venv/bin/pip install -e '.[fp8]'; make test installs it)",
        )
    if cfg.precision.fp8_emulate:
        return
    if not host.cuda:
        raise ConfigError(
            "precision",
            "fp8",
            "float8 matmuls need an NVIDIA GPU with compute capability 8.9+ (H100, H200, "
            "L40S, L4, B200, ...); this machine has none (precision.fp8_emulate=true "
            "emulates them, for tests)",
        )
    name = gpu_name()
    if fp8_capable(name) is False:
        raise ConfigError(
            "precision",
            "fp8",
            f"the {name} has no float8 tensor cores (compute capability 8.9+: H100, H200, L40S, L4, B200, ...)",
        )


def validate_context_parallel(cfg: Config, m, name: str, allowed: bool) -> None:
    """parallel.cp > 1: no packed samples' mask (data.document_masking), a recipe that splits
    the sequence, the project's decoder (its attention does the all-to-all), and a
    sequence and heads that divide."""
    p = cfg.parallel
    if cfg.data.document_masking:
        raise ConfigError(
            "parallel.cp",
            p.cp,
            "not with data.document_masking=true: each rank attends the whole "
            "sequence for its heads, and the packed samples' positions and mask would have to follow "
            "the split; use parallel.cp=1 (or data.document_masking=false)",
        )
    if not allowed:
        which = ", ".join(n for n, s in engines.specs().items() if s.parallelism.cp)
        raise ConfigError(
            "parallel.cp", p.cp, f"recipe {cfg.recipe.name} does not split the sequence; allowed recipes: {which}"
        )
    if cfg.model.kind == ModelKind.hf:
        raise ConfigError(
            "parallel.cp",
            p.cp,
            "model=hf runs its own attention; context parallel needs the project's decoder (model=gpt_*, llama3_*)",
        )
    if cfg.train.seq_len % p.cp:
        raise ConfigError(
            "parallel.cp",
            p.cp,
            f"must divide train.seq_len={cfg.train.seq_len} (each rank holds seq_len / cp positions)",
        )
    heads = m.n_heads // max(1, p.tp)
    if heads % p.cp:
        raise ConfigError(
            "parallel.cp",
            p.cp,
            f"must divide the attention heads per tensor-parallel rank: "
            f"model.n_heads={m.n_heads} / parallel.tp={p.tp} = {heads} (all-to-all splits them)",
        )


def check_trainable(cfg: Config) -> None:
    """train and submit (make plan takes any decoder's shape): the base is a pretrained folder."""
    if cfg.model.lora.rank > 0 and (cfg.model.kind != ModelKind.hf or cfg.model.pretrained is None):
        raise ConfigError(
            "model.lora.rank",
            cfg.model.lora.rank,
            "adapters train over a pretrained base: model=hf "
            "model.pretrained=<folder> (not a random start: model.config or the project's decoder; "
            "make plan takes any shape)",
        )


def validate_lora_targets(cfg: Config) -> None:
    """model.lora.targets name linears inside the decoder layers, and there are some."""
    lora = cfg.model.lora
    from launcher.models.lora import plain, targets  # local: torch (launch side)

    base = models.on_meta(plain(cfg))
    linears = sorted({n.rsplit(".", 1)[-1] for n in targets(base, models.model_layout(base).layers, None)})
    if not linears:  # GPT-2's Conv1D, say: nothing would train
        raise ConfigError(
            "model.lora.rank",
            lora.rank,
            "this model has no nn.Linear inside its decoder layers to adapt "
            "(GPT-2's Conv1D, for one); LoRA here takes Llama-family models",
        )
    missing = [t for t in (lora.targets or []) if str(t) not in linears]
    if missing:
        raise ConfigError(
            "model.lora.targets",
            missing[0],
            f"names no linear inside the decoder layers; this model's are {', '.join(linears)}",
        )


def validate_lora(cfg: Config) -> None:
    """model.lora: adapters over the whole layers (ddp, fsdp, ZeRO): tensor parallel would
    have to split each adapter with its layer, a pipeline stage's optimizer is its own."""
    from launcher.planner.lora import ENGINES  # local: torch (launch side)

    p, lora = cfg.parallel, cfg.model.lora
    if lora.rank < 0:
        raise ConfigError("model.lora.rank", lora.rank, "must be >= 0 (0: off, every weight trains)")
    if cfg.recipe.engine not in ENGINES or p.tp > 1 or p.pp > 1:
        raise ConfigError(
            "model.lora.rank",
            lora.rank,
            f"not with recipe={cfg.recipe.name} (tp={p.tp}, pp={p.pp}): "
            "adapters train under ddp, fsdp and zero1-3 without tensor or pipeline parallel",
        )
    if lora.alpha <= 0:
        raise ConfigError("model.lora.alpha", lora.alpha, "must be > 0 (the adapters' scale is alpha / rank)")
    if not 0 <= lora.dropout < 1:
        raise ConfigError("model.lora.dropout", lora.dropout, "must be in [0, 1)")
    if lora.targets is not None and (not isinstance(lora.targets, (list, tuple)) or not lora.targets):
        raise ConfigError(
            "model.lora.targets",
            lora.targets,
            "a non-empty list of projection names, or null (every linear inside the decoder layers)",
        )
    if lora.base_dtype.value == "nf4" and cfg.recipe.engine != "ddp":
        raise ConfigError(
            "model.lora.base_dtype",
            "nf4",
            f"the 4-bit base runs under the ddp engine for now (one GPU "
            f"or replicas), not recipe={cfg.recipe.name}; use base_dtype auto or bf16 there",
        )
    if cfg.precision.fp8:
        raise ConfigError("precision", "fp8", "not with model.lora (float8 layers would replace the adapted linears)")
    if lora.base_dtype.value == "nf4" and importlib.util.find_spec("torchao") is None:
        raise ConfigError(
            "model.lora.base_dtype",
            "nf4",
            "needs torchao's NF4 tensor, the fp8 extra (.venv/bin/pip install -e '.[fp8]')",
        )
    if lora.base_dtype.value == "bf16" and cfg.precision.name.value != "bf16":
        raise ConfigError(
            "model.lora.base_dtype",
            "bf16",
            f"under precision={cfg.precision.name.value} nothing casts "
            "the activations for the fp32 adapters; use base_dtype=auto (the compute dtype) or "
            "precision=bf16",
        )
    validate_lora_targets(cfg)
    if cfg.model.kind == ModelKind.hf and cfg.model.pretrained is not None:  # what the adapters train over
        from launcher.data.cache import cache_root  # local: start-up (numpy, 0.75 s, launch side)

        lora.base_digest = base_digest(cfg.model.pretrained, cache_root(cfg.data))


def base_digest(folder: str, memo_root, threads: int = 4) -> str:
    """sha256 over model.pretrained's config.json and *.safetensors, each file's sha256
    memoised as the data cache's are (by path, size and times: a later launch hashes nothing
    unchanged). A checkpoint records it; a resume onto another base is refused
    (launcher/launch/checks/fit.py)."""
    from launcher.data.cache import digests  # local: start-up (numpy, 0.75 s, launch side)

    root = Path(folder)
    files = sorted([root / "config.json", *root.glob("*.safetensors")])
    sums, _ = digests(memo_root, files, threads)
    h = hashlib.sha256()
    for f, digest in zip(files, sums):
        h.update(f"{f.name}\0{digest}\0".encode())
    return h.hexdigest()

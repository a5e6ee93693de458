"""The model facade's logic, re-exported by launcher.models: each function dispatches on
`model.kind` (the project's decoder, gpt.py; a Hugging Face causal LM, hf.py).

Imports inside functions, on purpose: the launch side imports this module (model_shape,
model_vocab_size) and must import no torch (tests/unit/test_imports.py), and transformers is
imported only for model=hf (about 2 s of start-up a run of the project's decoder does not pay).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from launcher.config import Config, ModelConfig, ModelKind
from launcher.config.derived import loss_chunks, sliceable_loss
from launcher.models import hf_adapter
from launcher.models.layout import Layout

if TYPE_CHECKING:
    import torch
    from torch import nn


def layout(cfg: Config) -> Layout:
    if cfg.model.kind == ModelKind.hf:
        from launcher.models import hf  # local: torch (launch side)

        return hf.layout(cfg.model)
    return Layout(tied=cfg.model.tie_embeddings)


def model_layout(model: nn.Module) -> Layout:
    """The layout of a built model (the project's decoder has no attribute: the default names)."""
    return getattr(model, "layout", None) or Layout(tied=model.cfg.tie_embeddings)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.get_submodule(model_layout(model).layers)


def build(cfg: Config, device: torch.device) -> nn.Module:
    """The whole model on `device`: built on meta, then materialized (drawn from
    train.seed, or read from model.pretrained). Recipes that split the model do not call
    this: they parallelize `on_meta(cfg)` first and `materialize` their part."""
    return materialize(on_meta(cfg), cfg, device)


def on_meta(cfg: Config) -> nn.Module:
    """The model's structure on the meta device: names and shapes, no storage."""
    import torch  # local: torch (launch side)

    return skeleton(cfg, torch.device("meta"))


def skeleton(cfg: Config, device: torch.device, dtype: torch.dtype | None = None) -> nn.Module:
    """The model's modules on `device` with their parameters allocated but not drawn
    (torch's and transformers' own init skipped: materialize fills them), made in `dtype`
    (default: torch's default). On meta nothing is allocated; under deepspeed.zero.Init
    each module is partitioned as soon as it is built, and cast to the engine's dtype:
    made in that dtype, no layer is first allocated and read whole in fp32."""
    import torch  # local: torch (launch side)

    from launcher.models.init import default_dtype, skip_torch_init  # local: torch (launch side)

    with skip_torch_init(), default_dtype(dtype), torch.device(device):
        if cfg.model.kind == ModelKind.hf:
            from launcher.models import hf  # local: torch (launch side)

            model = hf.build(cfg.model, device)
        else:
            from launcher.models.gpt import GPT  # local: torch (launch side)

            model = GPT(cfg.model)
        if cfg.model.lora.rank > 0:  # adapters before any recipe parallelizes (launcher/models/lora.py)
            from launcher.models import lora  # local: torch (launch side)

            lora.inject(
                model,
                cfg.model.lora,
                model_layout(model).layers,
                lora.base_dtype(cfg) if torch.device(device).type == "meta" else None,
            )
        return model


def materialize(model: nn.Module, cfg: Config, device: torch.device, storage: torch.device | None = None) -> nn.Module:
    """Storage on `storage` (default `device`; the host for FSDP's CPU offload) for the
    part of `model` this rank holds (all of it, an FSDP or tensor-parallel shard, a
    pipeline stage, a ZeRO-3 partition), its buffers computed, its parameters drawn
    layout-independently from train.seed on `device` or read from the owned slices of
    model.pretrained (launcher/models/init.py). No collective."""
    from launcher.models import init  # local: torch (launch side)

    specs = init_specs(cfg)
    fresh: dict = {}  # the LoRA adapters' specs
    if cfg.model.lora.rank > 0:  # the adapters are drawn, whatever the base is read from
        from launcher.models import lora  # local: torch (launch side)

        fresh = lora.init_specs(model, cfg.model.lora.rank)
        specs |= fresh
    pretrained = cfg.model.pretrained
    if pretrained is not None and cfg.model.kind != ModelKind.hf and device.type != "meta":  # an HF folder, our decoder
        pretrained = hf_adapter.reader(cfg.model)
    init.materialize(
        model,
        device,
        specs,
        cfg.train.seed,
        layout(cfg).tied_names(),
        init_buffers,
        pretrained,
        storage=storage,
        fresh=fresh,
    )
    if cfg.model.lora.base_dtype.value == "nf4" and cfg.model.lora.rank > 0 and device.type != "meta":
        from launcher.models import lora  # local: torch (launch side)

        lora.quantize_base(model)
    return model


def cast_params(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The parameters (not the buffers: the rotary table stays fp32) in `dtype`, ties kept.
    Meant for a model still on meta, where it costs nothing."""
    from torch import nn  # local: torch (launch side)

    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_floating_point():
                if id(p) not in new:
                    new[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                module._parameters[name] = new[id(p)]
    return model


def prepare(model: nn.Module, cfg: Config) -> nn.Module:
    """What every recipe wants before it parallelizes: activation checkpointing marked,
    and each decoder layer compiled (lazily: traced at the first forward, after the
    recipe sharded it), and the loss's slices (train.loss_chunks)."""
    set_activation_checkpointing(model, cfg)
    if cfg.model.kind != ModelKind.hf:
        sliceable = sliceable_loss(cfg, cfg.parallel.pp, cfg.parallel.tp)
        model.loss_chunks = loss_chunks(cfg, cfg.model.vocab_size, cfg.train.micro_batch, sliceable)
        model.offload_activations = cfg.train.activation_offload
    if cfg.precision.fp8:  # before compile, which traces the float8 layers
        from launcher.models import fp8  # local: torch (launch side)

        fp8.convert(model, cfg, model_layout(model).head)
    if cfg.train.compile:
        for layer in decoder_layers(model):
            layer.compile()
    return model


def offloaded(model: nn.Module) -> dict:
    """train.activation_offload: the bytes the last forward moved to the host, as a metric
    (the planner's host activation bytes); {} when nothing offloads."""
    for module in model.modules():
        hooks = getattr(module, "_offload", None)
        if hooks is not None:
            return {"mem/offloaded_activation_bytes": hooks.offloaded_bytes}
    return {}


def after_step(model: nn.Module, cfg: Config) -> dict:
    """After each optimizer step: an MoE's routers' load summed over the ranks, balance=bias's
    biases moved, the step's expert-load metrics (launcher/models/moe.py); {} for a dense model."""
    if not cfg.model.moe.experts:
        return {}
    from launcher.models import moe  # local: torch (launch side)

    return moe.after_step(model)


def init_specs(cfg: Config) -> dict:
    """Parameter name -> InitSpec: what each parameter is drawn from."""
    if cfg.model.kind == ModelKind.hf:
        from launcher.models import hf  # local: torch (launch side)

        return hf.init_specs(cfg.model)
    from launcher.models.gpt import init_specs as gpt_specs  # local: torch (launch side)

    return gpt_specs(cfg.model)


def init_buffers(model: nn.Module, device: torch.device) -> None:
    """Computed buffers (rotary tables) of every model inside `model`, on `device`."""
    from launcher.models.gpt import GPT  # local: torch (launch side)

    for module in list(model.modules()):
        if isinstance(module, GPT):
            module.init_buffers()
        elif hasattr(module, "hf") and hasattr(module, "init_buffers"):
            module.init_buffers()


def set_activation_checkpointing(model: nn.Module, cfg: Config) -> None:
    t = cfg.train
    if cfg.model.kind == ModelKind.hf:
        from launcher.models import hf  # local: torch (launch side)

        return hf.set_activation_checkpointing(model, t.activation_checkpointing, t.ac_every)
    from launcher.models.gpt import set_activation_checkpointing as gpt_ac  # local: torch (launch side)

    gpt_ac(model, t.activation_checkpointing, t.ac_every)


def flops_per_token(cfg: Config, seq_len: int) -> float:
    """Training FLOPs per token for MFU (see launcher.models.gpt.flops_per_token)."""
    from launcher.models.gpt import flops_per_token as gpt_flops  # local: torch (launch side)

    if cfg.model.kind == ModelKind.hf:
        from launcher.models import hf  # local: torch (launch side)

        return hf.flops_per_token(cfg.model, seq_len)
    return gpt_flops(cfg.model, seq_len)


def model_shape(cfg: Config) -> ModelConfig:
    """The decoder's shape in the project's fields (heads, layers, hidden sizes, vocabulary,
    tying): model=hf reads it from the Hugging Face config (launcher.models.hf.gpt_shape),
    so degree checks, pipeline cuts and the planner's formulas see one kind of model."""
    if cfg.model.kind == ModelKind.hf:
        from launcher.models.hf import gpt_shape  # local: torch (launch side)

        return gpt_shape(cfg.model)
    return cfg.model


def model_vocab_size(cfg: Config) -> int:
    """Embedding rows of the configured model, read from its config without building it
    (launcher.models.hf.model_vocab_size). The data's token ids must stay below it."""
    return model_shape(cfg).vocab_size

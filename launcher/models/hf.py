"""model=hf: a Hugging Face transformers causal LM, from local files only.

    model.config=path/config.json (or its folder)  AutoModelForCausalLM.from_config: random
                                                   init from train.seed, the same on every rank
    model.pretrained=path/folder                   the folder's config.json, and its
                                                   *.safetensors read shard-wise by each rank
                                                   (launcher/models/weights.py)

Nothing is fetched from a hub: launcher.offline() sets HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE
before this module imports transformers (and the launcher and each rank set them as they
start), and every load passes local_files_only. transformers is the optional extra `hf` (make setup installs it).

`HFCausalLM` gives the rest of the launcher the project decoder's interface: logits, or
the mean next-token loss given targets (the same fp32 cross-entropy as gpt.py), with the
transformers model's own parameter names (`model.layers.3.self_attn.q_proj.weight`,
`lm_head.weight`), so checkpoints of every recipe are keyed like save_pretrained's files.
Where the recipes need the parts (FSDP units, tensor-parallel splits, pipeline cuts), a
`Layout` names them, read from transformers' own metadata: the input and output
embeddings, the ModuleList of `_no_split_modules` layers, the base model's pipeline plan
(`base_model_pp_plan`: embedding, layers, final norm) and tensor-parallel plan
(`base_model_tp_plan`: which projections are column- and row-wise; Llama, Mistral,
Qwen2 and their kin). A model type without those plans still trains under ddp, fsdp and
ZeRO; tp and pp refuse it before launch.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

import engines
from launcher import offline
from launcher.config import ACMode, Config, ConfigError, HFAttention, ModelConfig, ModelKind
from launcher.models import weights
from launcher.models.attention import DocumentMask
from launcher.models.gpt import keep_matmuls, lm_loss
from launcher.models.hf_adapter import converted
from launcher.models.init import init_skipped, recorded_specs
from launcher.models.layout import Layout
from launcher.remote_code import remote_code

PP_PARTS = ("embed_tokens", "layers", "norm")  # base_model_pp_plan keys a pipeline can cut
TP_STYLES = ("colwise", "rowwise")  # base_model_tp_plan styles applied here (the Llama family's)


def _transformers():
    offline()  # before huggingface_hub is imported: nothing is fetched
    try:
        import transformers  # local: optional (transformers, after offline())
    except ImportError:
        raise ConfigError(
            "model", "hf", "needs transformers, the optional extra: pip install -e '.[hf]' (make setup installs it)"
        ) from None
    return transformers


def source(m: ModelConfig) -> tuple[str, str]:
    """(key, path) of the model's files: model.config or model.pretrained, exactly one."""
    if m.config is None and m.pretrained is None:
        raise ConfigError(
            "model.config",
            None,
            "model=hf needs exactly one of model.config=<config.json or its "
            "folder> (random init) or model.pretrained=<folder with config.json and *.safetensors>",
        )
    if m.config is not None and m.pretrained is not None:
        raise ConfigError(
            "model.pretrained",
            m.pretrained,
            "model.config is set too: give exactly one of them (pretrained weights come with their own config.json)",
        )
    return ("model.config", m.config) if m.config is not None else ("model.pretrained", m.pretrained)


@functools.lru_cache(maxsize=8)
def _config(key: str, path: str):
    p = Path(path)
    if key == "model.pretrained":
        if not p.is_dir():
            raise ConfigError(key, path, "no such folder (a local folder with config.json and *.safetensors)")
        if not any(p.glob("*.safetensors")):
            raise ConfigError(
                key,
                path,
                "no *.safetensors weights in this folder (save_pretrained writes them; "
                "pickled .bin weights are not loaded)",
            )
    elif not p.exists():
        raise ConfigError(key, path, "no such file or folder (a config.json, or the folder holding one)")
    file = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        raise ConfigError(key, path, "no config.json in this folder")
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(key, path, f"not a JSON model config ({e})") from None
    code = remote_code(file) or (remote_code(p) if p.is_dir() else None)
    if code:
        raise ConfigError(key, path, code)
    tf = _transformers()
    from transformers import CONFIG_MAPPING  # local: optional (transformers, after offline())

    # local: optional (transformers, after offline())
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type not in CONFIG_MAPPING:
        raise ConfigError(
            key,
            path,
            f"model_type {model_type!r} is not a model transformers {tf.__version__} "
            "builds offline (no remote code); causal LMs include llama, mistral, qwen2, gpt2",
        )
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(
            key,
            path,
            f"model_type {model_type!r} has no causal-LM class in transformers "
            "(AutoModelForCausalLM); pick a decoder such as llama",
        )
    try:
        return CONFIG_MAPPING[model_type].from_dict(raw)
    except Exception as e:  # the config class refuses its own fields
        raise ConfigError(key, path, f"transformers cannot read it: {str(e).strip().splitlines()[0]}") from None


def hf_config(m: ModelConfig):
    """The transformers config (a PretrainedConfig; cached, do not modify)."""
    return _config(*source(m))


def model_vocab_size(cfg: Config) -> int:
    """Embedding rows of the configured model (either kind), read from its config without
    building it. Token ids of the data must stay below it."""
    if cfg.model.kind == ModelKind.hf:
        return hf_config(cfg.model).vocab_size
    return cfg.model.vocab_size


# ----------------------------------------------------------------------------- building
def build(m: ModelConfig, device: torch.device) -> "HFCausalLM":
    """The model's structure from its config (model.config, or model.pretrained's
    config.json) on `device` (the launcher builds on meta; launcher.models.materialize then
    draws or reads the weights, each rank only its part), in fp32, in training mode."""
    offline()
    from transformers import AutoModelForCausalLM  # local: optional (transformers, after offline())
    from transformers.initialization import no_init_weights  # local: optional (transformers, after offline())

    kwargs = dict(dtype=torch.float32, attn_implementation=m.attn_implementation.value, trust_remote_code=False)
    skip = no_init_weights() if init_skipped() else contextlib.nullcontext()
    with torch.device(device), skip:
        model = AutoModelForCausalLM.from_config(copy.deepcopy(hf_config(m)), **kwargs)
        model.tie_weights()  # no_init_weights skips the tying post_init does
    model.train()  # training mode: dropout as configured, gradient checkpointing allowed
    model.config.use_cache = False
    return HFCausalLM(model)


def init_specs(m: ModelConfig) -> dict:
    """Parameter name -> InitSpec, as transformers' own `_init_weights` initialises this
    model type: its calls are recorded on the meta-device structure (normal_, ones_,
    zeros_, constant_ of transformers.initialization; an embedding's padding row zeroed).
    A parameter it leaves alone gets normal(0, initializer_range) when it is a matrix,
    ones when it is a vector named weight, zeros otherwise."""
    return dict(_init_specs(*source(m), m.attn_implementation.value))


@functools.lru_cache(maxsize=8)
def _init_specs(key: str, path: str, attn: str) -> tuple:
    model = _meta(key, path, attn)
    return tuple(recorded_specs(model, model.hf).items())


class HFCausalLM(nn.Module):
    """A transformers causal LM with the project decoder's interface. The transformers
    model's children are registered here under their own names (the model itself is held
    unregistered), so parameter names, state dicts and checkpoints are the model's own;
    its forward runs through the same module objects, after any recipe changed them."""

    def __init__(self, model: nn.Module):
        super().__init__()
        assert not list(model.named_parameters(recurse=False)), "parameters outside the model's children"
        self.__dict__["hf"] = model
        for name, child in model.named_children():
            self.add_module(name, child)
        self.layout = _layout_of(model)

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits, or the mean loss over the counted targets. `positions` (B, T): packed
        samples, as position_ids (rotary angles restart at each sample) with the
        block-causal mask (`packed_mask`) in the dtype of the embedded tokens."""
        if positions is None:
            logits = self.hf(input_ids=tokens, use_cache=False).logits
        else:
            h = self.hf.get_input_embeddings()(tokens)
            logits = self.hf(
                inputs_embeds=h, position_ids=positions, attention_mask=packed_mask(positions, h.dtype), use_cache=False
            ).logits
        return logits if targets is None else lm_loss(logits, targets)

    def run_blocks(self, layers, h: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """(index, layer) pairs in order on hidden states `h`, as the base model's forward
        calls them (a pipeline stage's middle): positions, rotary table and causal mask
        for the whole sequence (`positions`: packed samples, block-causal)."""
        from transformers.masking_utils import create_causal_mask  # local: optional (transformers, after offline())

        base = self.hf.get_submodule(self.hf.base_model_prefix)
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0) if positions is None else positions
        rotary = getattr(base, "rotary_emb", None)
        emb = rotary(h, position_ids=pos) if rotary is not None else None
        mask = create_causal_mask(
            config=self.hf.config,
            inputs_embeds=h,
            past_key_values=None,
            position_ids=pos,
            attention_mask=None if positions is None else packed_mask(positions, h.dtype),
        )
        for _, layer in layers:
            h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=emb)
        return h

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Computed buffers (rotary tables, Gemma's embedding scale...), as transformers'
        own `_init_weights` computes them; the module's parameters are marked initialised
        so that it leaves them (materialize fills them). Checked against from_config's own
        buffers for Llama and Gemma (embed_scale); a model type whose _init_weights did not
        set a buffer would keep what to_empty left there."""
        for module in self.hf.modules():
            own = [b for b in module.buffers(recurse=False) if b is not None]
            if not own:
                continue
            params = list(module.parameters(recurse=False))
            for p in params:
                p._is_hf_initialized = True
            for b in own:
                b._is_hf_initialized = False
            try:
                self.hf._init_weights(module)
            finally:
                for p in params:
                    del p._is_hf_initialized

    def train(self, mode: bool = True):
        self.hf.training = mode
        return super().train(mode)

    def set_submodule(self, target: str, module: nn.Module, strict: bool = False) -> None:
        super().set_submodule(target, module, strict)
        if "." not in target:  # a child: the model's forward and references see the same
            setattr(self.hf, target, module)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def packed_mask(positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive block-causal mask (B, 1, T, T) of packed samples, for transformers' sdpa
    and eager attention (a 4-D mask is used as given), in the dtype the attention computes
    in: autocast's, else `dtype` (the model's). transformers would build the same mask
    from packed position_ids itself (masking_utils.find_packed_sequence_indices: the same
    logits, tests/unit/test_packing.py), but as booleans, which SDPA copies to floats at
    every layer and saves for backward: B x T x T per layer instead of once."""
    device = positions.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    return DocumentMask(positions, flex=False).additive(dtype)


# ----------------------------------------------------------------------------- layout
def _layout_of(model: nn.Module) -> Layout:
    """The parts by name, from transformers' own metadata (see the module docstring).
    Without a pipeline plan `norm` is empty; without a colwise/rowwise plan `colwise` is."""
    names = {mod: name for name, mod in model.named_modules()}
    embed, head = names[model.get_input_embeddings()], names[model.get_output_embeddings()]
    units = set(getattr(model, "_no_split_modules", None) or ())
    layers = next(
        (
            name
            for name, mod in model.named_modules()
            if isinstance(mod, nn.ModuleList) and len(mod) and type(mod[0]).__name__ in units
        ),
        "",
    )
    prefix = model.base_model_prefix
    pp = list(getattr(model.config, "base_model_pp_plan", None) or {})
    norm = f"{prefix}.norm" if pp == list(PP_PARTS) and layers == f"{prefix}.layers" else ""
    plan = getattr(model.config, "base_model_tp_plan", None) or {}
    split = {k.removeprefix("layers.*."): v for k, v in plan.items()}
    usable = plan and all(k.startswith("layers.*.") for k in plan) and set(split.values()) <= set(TP_STYLES)
    colwise = tuple(k for k, v in split.items() if v == "colwise") if usable else ()
    rowwise = tuple(k for k, v in split.items() if v == "rowwise") if usable else ()
    layer0 = model.get_submodule(layers)[0] if layers else nn.Module()
    norms = tuple(
        n
        for n, mod in layer0.named_modules()
        if n
        and n not in split
        and list(mod.parameters(recurse=False))
        and not any(n.startswith(s + ".") for s in split)
    )
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return Layout(
        embed=embed,
        layers=layers,
        norm=norm,
        head=head,
        tied=tied,
        colwise=colwise,
        rowwise=rowwise,
        norms=norms,
        attention=colwise[0].split(".")[0] if colwise else "",
        mlp=rowwise[-1].split(".")[0] if rowwise else "",
    )


@functools.lru_cache(maxsize=8)
def _meta(key: str, path: str, attn: str) -> HFCausalLM:
    source: dict[str, Any] = {key.split(".")[1]: path}  # model.pretrained or model.hf_config
    m = ModelConfig(kind=ModelKind.hf, **source, attn_implementation=HFAttention(attn))
    return build(m, torch.device("meta"))


def structure(m: ModelConfig) -> HFCausalLM:
    """The model on the meta device, cached: read it, never modify it (models.on_meta makes a fresh one)."""
    return _meta(*source(m), m.attn_implementation.value)


def layout(m: ModelConfig) -> Layout:
    return structure(m).layout


def gpt_shape(m: ModelConfig) -> ModelConfig:
    """The project-decoder fields of the same sizes (heads, layers, hidden, SwiGLU width,
    vocabulary, tying, longest sequence): what the degree checks, the pipeline's
    balancing and the planner's formulas read. Exact for the Llama family."""
    c = hf_config(m)
    heads = c.num_attention_heads
    return ModelConfig(
        name=f"hf:{c.model_type}",
        vocab_size=c.vocab_size,
        dim=c.hidden_size,
        n_layers=c.num_hidden_layers,
        n_heads=heads,
        n_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
        ffn_dim=getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * c.hidden_size,
        max_seq_len=getattr(c, "max_position_embeddings", None) or 1 << 30,
        tie_embeddings=layout(m).tied,
    )


def is_llama_like(m: ModelConfig) -> bool:
    """The project decoder's formulas hold: a Llama-layout model (pipeline and tensor-parallel
    plans), no biases, head_dim = hidden / heads, a gated MLP (3 matrices)."""
    c, lay = hf_config(m), layout(m)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return (
        bool(lay.norm and lay.colwise)
        and len(lay.colwise) == 5
        and not getattr(c, "attention_bias", False)
        and not getattr(c, "mlp_bias", False)
        and head_dim * c.num_attention_heads == c.hidden_size
    )


def flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """6 per matmul weight (the head included, tied or not) + attention 12 x layers x
    hidden x seq, as gpt.flops_per_token. The matmul weights are the decoder layers'
    matrices (every >= 2-D parameter of a layer, counted on the meta model) and the head:
    for the Llama family exactly q, k, v, o, gate, up, down; for a mixture of experts this
    counts every expert (an upper bound)."""
    model, c = structure(m), hf_config(m)
    layers = model.get_submodule(model.layout.layers)
    matmul = sum(p.numel() for layer in layers for p in layer.parameters() if p.dim() >= 2)
    head = model.hf.get_output_embeddings().weight.numel()
    return 6.0 * (matmul + head) + 12.0 * c.num_hidden_layers * c.hidden_size * seq_len


def set_activation_checkpointing(model: HFCausalLM, mode: ACMode, every: int) -> None:
    """The model's own switch, non-reentrant: every decoder layer recomputes in backward
    (full; op: keeping attention's and every other matmul's outputs), or every `every`-th, layers
    0, every, 2 x every... (selective)."""
    if mode == ACMode.none:
        return
    n = every if mode == ACMode.selective else 1
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if mode == ACMode.op:  # the layers keep attention's and every other matmul's outputs
        kwargs["context_fn"] = keep_matmuls
    if hasattr(model.hf, "activation_checkpointing_enable"):  # transformers >= 5.23 (the old name is deprecated)
        model.hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, every_n_layers=n)
        return
    model.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    for i, layer in enumerate(model.get_submodule(model.layout.layers)):
        layer.gradient_checkpointing = i % n == 0


# ----------------------------------------------------------------------------- validation
def check(cfg: Config) -> None:
    """Launch side: the files, the model type, the sequence length and what the recipe
    needs of the layout. Raises ConfigError (one line, exit 2)."""
    m, p = cfg.model, cfg.parallel
    c = hf_config(m)
    lay = layout(m)
    shape = gpt_shape(m)
    if not lay.layers:
        raise ConfigError(
            *source(m),
            f"model_type {c.model_type!r}: transformers names no decoder-layer class "
            "(_no_split_modules) to shard and checkpoint layer by layer",
        )
    if cfg.train.seq_len > shape.max_seq_len:
        raise ConfigError(
            "train.seq_len", cfg.train.seq_len, f"must be <= the model's max_position_embeddings={shape.max_seq_len}"
        )

    can = engines.spec(cfg.recipe.engine).parallelism
    if can.tp and p.tp > 1:
        if not lay.colwise:
            raise ConfigError(
                "parallel.tp",
                p.tp,
                f"model_type {c.model_type!r} has no Llama-style tensor-parallel plan "
                f"(transformers' base_model_tp_plan with {'/'.join(TP_STYLES)} only); use fsdp or pp",
            )
        if p.sequence_parallel:
            raise ConfigError(
                "parallel.sequence_parallel",
                "true",
                "not with model=hf: the model computes positions "
                "from the sequence it is given, a slice under sequence parallel",
            )
    if can.pp and p.pp > 1 and not lay.norm:
        raise ConfigError(
            "parallel.pp",
            p.pp,
            f"model_type {c.model_type!r} has no pipeline plan of embedding, "
            "layers and final norm (transformers' base_model_pp_plan); use fsdp or ZeRO",
        )
    if m.pretrained is not None:
        check_weights(m)


def check_weights(m: ModelConfig) -> None:
    """model.pretrained: every parameter of the model is in the folder's *.safetensors with
    its shape, nothing else is, and no file is cut short (headers and file sizes only;
    nothing is loaded). A tied head may be absent (save_pretrained stores it once), and
    buffers a file may carry (an old rotary inv_freq) are ignored. One line naming the
    tensor and the file, before any rank starts: otherwise each rank would stop at the
    tensor it owns, some ranks never."""
    model = structure(m)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    ignore = [name for name, _ in model.named_buffers()]
    tied = model.layout.tied_names()
    if tied is not None:
        ignore.append(tied[0])
    try:
        weights.check(weights.index(m.pretrained), expected, ignore=ignore)
    except weights.WeightsError as e:
        raise ConfigError("model.pretrained", m.pretrained, converted(hf_config(m).model_type) or str(e)) from None

"""A Hugging Face folder read into the project's decoder, and the decoder written back as one
(torchtitan's state-dict adapter): `model=mixtral_8x7b model.pretrained=DIR`.

    HF (on disk)                                        project (launcher/models/gpt.py, moe.py)
    model.embed_tokens.weight                           tok_embeddings.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight    layers.{i}.attention.w{q,k,v,o}.weight  (q, k: rotary rows)
    model.layers.{i}.{input,post_attention}_layernorm   layers.{i}.{attention,ffn}_norm.weight
    model.layers.{i}.block_sparse_moe.gate.weight       layers.{i}.feed_forward.router.weight   (E, dim)
    ...block_sparse_moe.experts.{e}.w1/w3.weight        layers.{i}.feed_forward.experts.w1/w3   (E, hidden, dim)
    ...block_sparse_moe.experts.{e}.w2.weight           layers.{i}.feed_forward.experts.w2      (E, dim, hidden)
      (or transformers' fused mlp.experts.gate_up_proj (E, 2 hidden, dim) and down_proj)
    model.layers.{i}.mlp.{gate,up,down}_proj.weight     layers.{i}.feed_forward.w{1,3,2}.weight (a dense block)
    model.norm.weight, lm_head.weight                   norm.weight, output.weight

Each rank reads only the box (FSDP, expert parallel) or flat range (ZeRO-3) of each stacked
tensor it owns: an expert's rows come from that expert's own tensor, the two halves of a fused
gate_up_proj from their own rows; nothing is stacked or fused in memory, so no rank holds more
than its part plus one read chunk (or one attention head, for the rotary rows), whatever the
checkpoint's size (Mixtral-8x22B: 280 GB in bf16). q and k rows are permuted per head: gpt.py
rotates adjacent channel pairs (2j, 2j+1), transformers rotates halves (j, j + head_dim/2).

Why the project's decoder (model=mixtral_8x7b), not model=hf: transformers' Mixtral fuses its
experts under names other than the files' (its conversion mapping renames and stacks them at
load), while the project's MoE already has the stacked experts expert parallelism splits, the
router metrics, the planner's formulas and the meta-device build; the user names the shape
(a conf/model file) and the launch side checks it against the folder's config.json, one line
naming both values on any difference. Folders whose architecture the decoder does not have
(Qwen3-MoE: head_dim apart from dim / heads and per-head q/k norms; Qwen2-MoE: attention biases
and a gated shared expert) are refused in one line naming what is missing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from launcher.config import Config, ConfigError, ModelConfig, MoEBalance, MoEScore, expert_dim, ffn_dim

TYPES = ("mixtral", "llama", "mistral")
LACKS = {"qwen3_moe": "head_dim apart from dim / n_heads and per-head q/k RMSNorm (q_norm, k_norm)",
         "qwen2_moe": "attention biases (q/k/v_proj.bias) and a sigmoid-gated shared expert (shared_expert_gate)"}
KEY = "model.pretrained"


def folder_config(path: str) -> dict:
    """config.json of model.pretrained (read as JSON: no transformers on the launch side)."""
    from launcher.remote_code import remote_code

    p = Path(path)
    if not p.is_dir():
        raise ConfigError(KEY, path, "no such folder (a save_pretrained folder with config.json and *.safetensors)")
    try:
        raw = json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(KEY, path, f"no readable config.json ({e})") from None
    code = remote_code(p)
    if code:
        raise ConfigError(KEY, path, code)
    if not isinstance(raw, dict):
        raise ConfigError(KEY, path, "config.json is not a JSON object")
    kind = raw.get("model_type")
    if kind not in TYPES:
        lacks = f": it needs {LACKS[kind]}, which the project's decoder lacks" if kind in LACKS else ""
        raise ConfigError(KEY, path, f"model_type {kind!r} is not read into the project's decoder{lacks}; "
                          f"it reads {', '.join(TYPES)} folders")
    return raw


def converted(model_type: str) -> str | None:
    """model=hf, whose tensors did not match the folder's: why, when transformers converts
    this model type's files at load (its conversion mapping: Mixtral's and Qwen's MoE experts
    are stored one by one and fused in the model), which model=hf does not apply."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    if not get_checkpoint_conversion_mapping(model_type):
        return None
    where = ("read it into the project's decoder: a model config of its shape (model=mixtral_8x7b...) with "
             "model.pretrained=DIR" if model_type in TYPES else f"the project's decoder lacks {LACKS[model_type]}"
             if model_type in LACKS else "neither model=hf nor the project's decoder reads it")
    return (f"model_type {model_type!r}: transformers renames and fuses this folder's tensors at load (its "
            f"conversion mapping, the MoE experts stored one by one), which model=hf does not apply; {where}")


def _rope(raw: dict) -> tuple[str, float]:
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    return rope.get("rope_type", rope.get("type", "default")), float(rope.get("rope_theta", raw.get("rope_theta", 1e4)))


def pairs(m: ModelConfig, raw: dict) -> list[tuple[str, object, str, object]]:
    """(project key, its value, the folder's key, its value) that must be equal."""
    moe, rope_theta = m.moe.experts > 0, _rope(raw)[1]
    heads = raw.get("num_attention_heads")
    out = [("model.vocab_size", m.vocab_size, "vocab_size", raw.get("vocab_size")),
           ("model.dim", m.dim, "hidden_size", raw.get("hidden_size")),
           ("model.n_layers", m.n_layers, "num_hidden_layers", raw.get("num_hidden_layers")),
           ("model.n_heads", m.n_heads, "num_attention_heads", heads),
           ("model.n_kv_heads", m.n_kv_heads or m.n_heads, "num_key_value_heads", raw.get("num_key_value_heads") or heads),
           ("model.moe.experts", m.moe.experts, "num_local_experts", raw.get("num_local_experts", 0)),
           ("model.moe.expert_dim" if moe else "model.ffn_dim", expert_dim(m) if moe else ffn_dim(m),
            "intermediate_size", raw.get("intermediate_size")),
           ("model.rope_theta", m.rope_theta, "rope_theta", rope_theta),
           ("model.norm_eps", m.norm_eps, "rms_norm_eps", raw.get("rms_norm_eps")),
           ("model.tie_embeddings", m.tie_embeddings, "tie_word_embeddings", bool(raw.get("tie_word_embeddings")))]
    if moe:
        out.append(("model.moe.top_k", m.moe.top_k, "num_experts_per_tok", raw.get("num_experts_per_tok")))
    return out


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(b, (int, float)) and math.isclose(float(a), float(b), rel_tol=1e-9)
    return a == b


def check_config(cfg: Config) -> dict:
    """Launch side: the folder's config.json against the configured decoder, one line on the
    first difference (both values named), or on a feature the decoder does not have."""
    m, path = cfg.model, cfg.model.pretrained
    raw = folder_config(path)
    file = Path(path) / "config.json"
    for key, value, theirs, their_value in pairs(m, raw):
        if not _same(value, their_value):
            raise ConfigError(key, value, f"{file} has {theirs}={their_value}: the decoder must have the folder's "
                              f"shape (set {key}={their_value})")
    heads = raw.get("head_dim")
    problems = [(raw.get("hidden_act", "silu") != "silu", f"hidden_act={raw.get('hidden_act')} (the decoder: silu)"),
                (heads not in (None, m.dim // m.n_heads), f"head_dim={heads} (the decoder: dim / n_heads = "
                 f"{m.dim // m.n_heads})"),
                (_rope(raw)[0] != "default", f"rope type {_rope(raw)[0]} (the decoder: default rotary)"),
                (bool(raw.get("attention_bias") or raw.get("mlp_bias")), "biases (the decoder has none)"),
                ((raw.get("sliding_window") or cfg.train.seq_len) < cfg.train.seq_len,
                 f"sliding_window={raw.get('sliding_window')} below train.seq_len={cfg.train.seq_len} "
                 "(the decoder attends to the whole window)"),
                (bool(raw.get("router_jitter_noise")), f"router_jitter_noise={raw.get('router_jitter_noise')} "
                 "(the decoder's router has no noise)"),
                ((raw.get("max_position_embeddings") or m.max_seq_len) < m.max_seq_len,
                 f"max_position_embeddings={raw.get('max_position_embeddings')} below model.max_seq_len={m.max_seq_len}")]
    for bad, what in problems:
        if bad:
            raise ConfigError(KEY, path, f"{file}: {what}")
    if m.moe.experts:
        e = m.moe
        router = [("model.moe.score", e.score.value, MoEScore.softmax.value), ("model.moe.norm_topk", e.norm_topk, True),
                  ("model.moe.route_scale", e.route_scale, 1.0), ("model.moe.shared_experts", e.shared_experts, 0),
                  ("model.moe.first_dense", e.first_dense, 0)]
        for key, value, want in router:
            if value != want:
                raise ConfigError(key, value, f"{raw['model_type']} ({file}) routes with {key.split('.')[-1]}={want}")
        if e.top_k == 1:
            raise ConfigError("model.moe.top_k", 1, f"{file}: Mixtral renormalizes a single expert's weight to 1, "
                              "the decoder's router keeps its score (top_k >= 2 match)")
    return raw


def check(cfg: Config) -> None:
    """Launch side, before any rank: config.json matches (check_config), and every parameter of
    the decoder is in the folder's *.safetensors with its shape, nothing else is, no file cut
    short (headers and file sizes only; nothing is loaded)."""
    import torch

    from launcher.models import weights
    from launcher.models.gpt import GPT
    from launcher.models.init import canonical, skip_torch_init
    from launcher.models.layout import Layout

    check_config(cfg)
    with skip_torch_init(), torch.device("meta"):
        model = GPT(cfg.model)
    tied = Layout(tied=cfg.model.tie_embeddings).tied_names()
    try:
        entries = weights.index(cfg.model.pretrained)
        used: set[str] = set()
        for name, p in model.named_parameters():
            if canonical(name, tied) != name:
                continue
            src = source(cfg.model, entries, name)
            if src.shape != tuple(p.shape):
                first = src.entries[0]
                raise weights.WeightsError(f"{first.name} in {first.file}: shape {src.shape} read as {name}, where "
                                           f"the model has {tuple(p.shape)}")
            used |= {e.name for e in src.entries}
        for name in sorted(set(entries) - used):
            if not name.endswith("rotary_emb.inv_freq") and not (tied and name == "lm_head.weight"):
                raise weights.WeightsError(f"{name} in {entries[name].file}: not a parameter of the model")
    except weights.WeightsError as e:
        raise ConfigError(KEY, cfg.model.pretrained, str(e)) from None


# ----------------------------------------------------------------------------- the names
def hf_name(key: str) -> str:
    """The folder's name of a project parameter that maps one to one (everything but the
    experts; q and k rows are permuted, not renamed)."""
    top = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if key in top:
        return top[key]
    _, i, rest = key.split(".", 2)
    per_layer = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
                 "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
                 "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj",
                 "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                 "feed_forward.router": "block_sparse_moe.gate"}
    return f"model.layers.{i}.{per_layer[rest.removesuffix('.weight')]}.weight"


def source(m: ModelConfig, entries: dict, key: str):
    """How the folder holds project parameter `key` (a Source); WeightsError when it does not."""
    from launcher.models import hf_sources as S

    head_dim = m.dim // m.n_heads
    if ".feed_forward.experts." in key or ".feed_forward.router." in key:
        i, leaf = key.split(".")[1], key.rsplit(".", 1)[1]
        moe = _moe_prefix(entries, f"model.layers.{i}.")
        if leaf == "weight":
            return S.Whole(_entry(entries, moe + "gate.weight"))
        if moe + "experts.gate_up_proj" in entries:  # transformers' own fused layout
            fused = _entry(entries, moe + "experts.down_proj" if leaf == "w2" else moe + "experts.gate_up_proj")
            return S.Whole(fused) if leaf == "w2" else S.Half(fused, second=leaf == "w3")
        return S.Stack([_entry(entries, f"{moe}experts.{e}.{leaf}.weight") for e in range(m.moe.experts)])
    entry = _entry(entries, hf_name(key))
    if key.endswith("attention.wq.weight") or key.endswith("attention.wk.weight"):
        return S.RotaryRows(entry, head_dim)
    return S.Whole(entry)


def _moe_prefix(entries: dict, layer: str) -> str:
    """block_sparse_moe. (Mixtral's files) or mlp. (transformers' own names)."""
    return next((layer + p for p in ("block_sparse_moe.", "mlp.") if layer + p + "gate.weight" in entries),
                layer + "block_sparse_moe.")


def _entry(entries: dict, name: str):
    from launcher.models.weights import WeightsError

    if name not in entries:
        folder = next(iter(entries.values())).file.parent if entries else "the folder"
        raise WeightsError(f"{name}: missing from {folder} (the folder's *.safetensors hold {len(entries)} tensors)",
                           name, None)
    return entries[name]


def reader(m: ModelConfig):
    """The rank side: read(key, dst, shape, box, flat) filling this rank's part of `key` from
    model.pretrained (launcher/models/init.py calls it for every parameter)."""
    from launcher.models import weights

    entries = weights.index(m.pretrained)

    def read(key, dst, shape, box, flat) -> None:
        src = source(m, entries, key)
        if src.shape != tuple(shape):
            raise weights.WeightsError(f"{key}: the folder holds shape {src.shape}, the model {tuple(shape)}", key)
        if dst.numel():
            src.read_flat(flat[0], flat[1], dst) if flat is not None else src.read(box, dst)
    return read


# ----------------------------------------------------------------------------- export
def to_hf(m: ModelConfig, state: dict):
    """(a transformers config, the state under its model's names: MixtralForCausalLM with
    fused experts for an MoE, LlamaForCausalLM for a dense decoder); save_pretrained then
    writes the files' per-expert layout. Refused in one line for an MoE Mixtral cannot hold."""
    import torch

    from launcher import offline

    offline()
    e = m.moe
    if e.experts:
        router = ((e.score == MoEScore.softmax and e.norm_topk and e.top_k > 1, f"score={e.score.value} top_k={e.top_k}"),
                  (e.route_scale == 1.0, f"route_scale={e.route_scale}"), (e.shared_experts == 0, "shared experts"),
                  (e.first_dense == 0, "dense first blocks"), (e.balance != MoEBalance.bias, "balance=bias's biases"))
        for ok, what in router:
            if not ok:
                raise ConfigError("export.format", "hf", f"the MoE has {what}, which Mixtral's layout has not "
                                  "(softmax top-k >= 2 renormalized, every block routed); export.format=safetensors")
    out, gate_up = {}, {}
    for key, value in state.items():
        if key.endswith(".router.bias"):
            continue
        if ".feed_forward.experts." in key:
            i, leaf = key.split(".")[1], key.rsplit(".", 1)[1]
            prefix = f"model.layers.{i}.mlp.experts."
            if leaf == "w2":
                out[prefix + "down_proj"] = value
            else:
                gate_up.setdefault(prefix + "gate_up_proj", {})[leaf] = value
            continue
        name = hf_name(key).replace(".block_sparse_moe.", ".mlp.")
        if key.endswith("attention.wq.weight") or key.endswith("attention.wk.weight"):
            hd = m.dim // m.n_heads
            value = value.view(-1, hd // 2, 2, value.shape[-1]).transpose(1, 2).reshape(value.shape)
        out[name] = value
    for name, halves in gate_up.items():
        out[name] = torch.cat([halves["w1"], halves["w3"]], dim=1)
    return hf_config(m), out


def hf_config(m: ModelConfig):
    from transformers import LlamaConfig, MixtralConfig

    common = dict(vocab_size=m.vocab_size, hidden_size=m.dim, num_hidden_layers=m.n_layers,
                  num_attention_heads=m.n_heads, num_key_value_heads=m.n_kv_heads or m.n_heads,
                  head_dim=m.dim // m.n_heads, max_position_embeddings=m.max_seq_len, rms_norm_eps=m.norm_eps,
                  rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
                  tie_word_embeddings=m.tie_embeddings, hidden_act="silu", bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
    if not m.moe.experts:
        return LlamaConfig(intermediate_size=ffn_dim(m), attention_bias=False, mlp_bias=False, **common)
    return MixtralConfig(intermediate_size=expert_dim(m), num_local_experts=m.moe.experts,
                         num_experts_per_tok=m.moe.top_k, router_aux_loss_coef=m.moe.aux_loss_coef,
                         router_jitter_noise=0.0, sliding_window=None, **common)

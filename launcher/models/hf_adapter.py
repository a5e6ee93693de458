"""A Hugging Face folder read into the project's decoder, and the decoder written back as one
(torchtitan's state-dict adapter): `model=mixtral_8x7b model.pretrained=DIR`, `model=qwen3_30b_a3b ...`.

    HF (on disk)                                        project (launcher/models/gpt.py, moe.py)
    model.embed_tokens.weight                           tok_embeddings.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight    layers.{i}.attention.w{q,k,v,o}.weight  (q, k: rotary rows)
    ...self_attn.{q,k,v}_proj.bias (Qwen2-MoE)          layers.{i}.attention.w{q,k,v}.bias      (q, k: rotary rows)
    ...self_attn.{q,k}_norm.weight (Qwen3-MoE)          layers.{i}.attention.{q,k}_norm.weight  (rotary rows)
    model.layers.{i}.{input,post_attention}_layernorm   layers.{i}.{attention,ffn}_norm.weight
    model.layers.{i}.block_sparse_moe.gate.weight       layers.{i}.feed_forward.router.weight   (E, dim; Qwen: mlp.gate)
    ...block_sparse_moe.experts.{e}.w1/w3.weight        layers.{i}.feed_forward.experts.w1/w3   (E, hidden, dim)
    ...block_sparse_moe.experts.{e}.w2.weight           layers.{i}.feed_forward.experts.w2      (E, dim, hidden)
      (Qwen: mlp.experts.{e}.gate_proj/up_proj/down_proj; or transformers' fused
       mlp.experts.gate_up_proj (E, 2 hidden, dim) and down_proj)
    ...mlp.shared_expert.{gate,up,down}_proj.weight     layers.{i}.feed_forward.shared.w{1,3,2}.weight
    ...mlp.shared_expert_gate.weight (1, dim)           layers.{i}.feed_forward.shared_gate.weight
    model.layers.{i}.mlp.{gate,up,down}_proj.weight     layers.{i}.feed_forward.w{1,3,2}.weight (a dense block)
    model.norm.weight, lm_head.weight                   norm.weight, output.weight

Each rank reads only the box (FSDP, expert parallel) or flat range (ZeRO-3) of each stacked
tensor it owns: an expert's rows come from that expert's own tensor, the two halves of a fused
gate_up_proj from their own rows; nothing is stacked or fused in memory, so no rank holds more
than its part plus one read chunk (or one attention head, for the rotary rows), whatever the
checkpoint's size (Mixtral-8x22B: 280 GB in bf16). q and k rows (and their biases and per-head
norms) are permuted per head: gpt.py rotates adjacent channel pairs (2j, 2j+1), transformers
rotates halves (j, j + head_dim/2).

Why the project's decoder, not model=hf: transformers' MoEs fuse their experts under names
other than the files' (its conversion mapping renames and stacks them at load), while the
project's MoE already has the stacked experts expert parallelism splits, the router metrics,
the planner's formulas and the meta-device build; the user names the shape (a conf/model
file) and the launch side checks it against the folder's config.json, one line naming both
values on any difference, or the feature the decoder lacks (launcher/models/hf_families.py:
the model types, their fields, what the export writes).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from launcher import offline
from launcher.config import Config, ConfigError, ModelConfig, head_dim
from launcher.models.hf_families import EXAMPLES, TYPES, hf_config, pairs, problems, router_wants
from launcher.models.layout import Layout
from launcher.remote_code import remote_code

KEY = "model.pretrained"


def folder_config(path: str) -> dict:
    """config.json of model.pretrained (read as JSON: no transformers on the launch side)."""
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
        raise ConfigError(
            KEY,
            path,
            f"model_type {kind!r} is not read into the project's decoder; it reads {', '.join(TYPES)} folders",
        )
    return raw


def converted(model_type: str) -> str | None:
    """model=hf, whose tensors did not match the folder's: why, when transformers converts
    this model type's files at load (its conversion mapping: Mixtral's and Qwen's MoE experts
    are stored one by one and fused in the model), which model=hf does not apply."""
    # local: optional (transformers, after offline())
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    if not get_checkpoint_conversion_mapping(model_type):
        return None
    where = (
        f"read it into the project's decoder: a model config of its shape ({EXAMPLES}...) with model.pretrained=DIR"
        if model_type in TYPES
        else "neither model=hf nor the project's decoder reads it"
    )
    return (
        f"model_type {model_type!r}: transformers renames and fuses this folder's tensors at load (its "
        f"conversion mapping, the MoE experts stored one by one), which model=hf does not apply; {where}"
    )


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
    for bad, what in problems(raw, cfg.train.seq_len, m.max_seq_len):
        if bad:
            raise ConfigError(KEY, path, f"{file}: {what}")
    for key, value, theirs, want in pairs(m, raw):
        if not _same(value, want):
            raise ConfigError(
                key, value, f"{file} has {theirs}: the decoder must have the folder's shape (set {key}={want})"
            )
    if m.moe.experts:
        for key, value, want in router_wants(raw["model_type"], m):
            if value != want:
                raise ConfigError(key, value, f"{raw['model_type']} ({file}) routes with {key.split('.')[-1]}={want}")
        if m.moe.top_k == 1 and m.moe.norm_topk:
            raise ConfigError(
                "model.moe.top_k",
                1,
                f"{file}: {raw['model_type']} renormalizes a single expert's weight "
                "to 1, the decoder's router keeps its score (top_k >= 2, or norm_topk=false, match)",
            )
    return raw


def check(cfg: Config) -> None:
    """Launch side, before any rank: config.json matches (check_config), and every parameter of
    the decoder is in the folder's *.safetensors with its shape, nothing else is, no file cut
    short (headers and file sizes only; nothing is loaded)."""
    import torch  # local: torch (launch side)

    from launcher.models import weights  # local: torch (launch side)
    from launcher.models.gpt import GPT  # local: torch (launch side)
    from launcher.models.init import canonical, skip_torch_init  # local: torch (launch side)

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
                raise weights.WeightsError(
                    f"{first.name} in {first.file}: shape {src.shape} read as {name}, where "
                    f"the model has {tuple(p.shape)}"
                )
            used |= {e.name for e in src.entries}
        for name in sorted(set(entries) - used):
            if not name.endswith("rotary_emb.inv_freq") and not (tied and name == "lm_head.weight"):
                raise weights.WeightsError(f"{name} in {entries[name].file}: not a parameter of the model")
    except weights.WeightsError as e:
        raise ConfigError(KEY, cfg.model.pretrained, str(e)) from None


# ----------------------------------------------------------------------------- the names
PER_LAYER = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "attention.q_norm": "self_attn.q_norm",
    "attention.k_norm": "self_attn.k_norm",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "feed_forward.router": "block_sparse_moe.gate",
    "feed_forward.shared.w1": "mlp.shared_expert.gate_proj",
    "feed_forward.shared.w3": "mlp.shared_expert.up_proj",
    "feed_forward.shared.w2": "mlp.shared_expert.down_proj",
    "feed_forward.shared_gate": "mlp.shared_expert_gate",
}
ROTARY = ("attention.wq.", "attention.wk.", "attention.q_norm.", "attention.k_norm.")
"""Parameters whose rows are per-head channels rotary permutes (weights, biases, per-head norms)."""
EXPERT_LEAVES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
"""Qwen's per-expert names of Mixtral's w1, w3, w2."""


def hf_name(key: str) -> str:
    """The folder's name of a project parameter that maps one to one (everything but the
    experts; q and k rows are permuted, not renamed)."""
    top = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if key in top:
        return top[key]
    _, i, rest = key.split(".", 2)
    module, leaf = rest.rsplit(".", 1)
    return f"model.layers.{i}.{PER_LAYER[module]}.{leaf}"


def rotary(key: str) -> bool:
    return any(f".{r}" in key for r in ROTARY)


def source(m: ModelConfig, entries: dict, key: str):
    """How the folder holds project parameter `key` (a Source); WeightsError when it does not."""
    from launcher.models import hf_sources as S  # local: torch (launch side)

    if ".feed_forward.experts." in key or ".feed_forward.router." in key:
        i, leaf = key.split(".")[1], key.rsplit(".", 1)[1]
        moe = _moe_prefix(entries, f"model.layers.{i}.")
        if leaf == "weight":
            return S.Whole(_entry(entries, moe + "gate.weight"))
        if moe + "experts.gate_up_proj" in entries:  # transformers' own fused layout
            fused = _entry(entries, moe + "experts.down_proj" if leaf == "w2" else moe + "experts.gate_up_proj")
            return S.Whole(fused) if leaf == "w2" else S.Half(fused, second=leaf == "w3")
        if f"{moe}experts.0.{EXPERT_LEAVES[leaf]}.weight" in entries:  # Qwen's files
            leaf = EXPERT_LEAVES[leaf]
        return S.Stack([_entry(entries, f"{moe}experts.{e}.{leaf}.weight") for e in range(m.moe.experts)])
    entry = _entry(entries, hf_name(key))
    return S.RotaryRows(entry, head_dim(m)) if rotary(key) else S.Whole(entry)


def _moe_prefix(entries: dict, layer: str) -> str:
    """block_sparse_moe. (Mixtral's files) or mlp. (Qwen's, transformers' own names)."""
    return next(
        (layer + p for p in ("block_sparse_moe.", "mlp.") if layer + p + "gate.weight" in entries),
        layer + "block_sparse_moe.",
    )


def _entry(entries: dict, name: str):
    from launcher.models.weights import WeightsError  # local: torch (launch side)

    if name not in entries:
        folder = next(iter(entries.values())).file.parent if entries else "the folder"
        raise WeightsError(
            f"{name}: missing from {folder} (the folder's *.safetensors hold {len(entries)} tensors)", name, None
        )
    return entries[name]


def reader(m: ModelConfig):
    """The rank side: read(key, dst, shape, box, flat) filling this rank's part of `key` from
    model.pretrained (launcher/models/init.py calls it for every parameter)."""
    from launcher.models import weights  # local: torch (launch side)

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
    """(a transformers config, the state under its model's names: Mixtral, Qwen3-MoE or
    Qwen2-MoE with fused experts for an MoE, Llama for a dense decoder: hf_families.export_type);
    save_pretrained then writes the files' per-expert layout. Refused in one line for a decoder
    none of them holds."""
    import torch  # local: torch (launch side)

    offline()
    config = hf_config(m)  # refuses first
    out: dict = {}
    gate_up: dict = {}
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
        if rotary(key):  # adjacent pairs back to halves, per head
            hd = head_dim(m)
            value = value.view(-1, hd // 2, 2, *value.shape[1:]).transpose(1, 2).reshape(value.shape)
        out[hf_name(key).replace(".block_sparse_moe.", ".mlp.")] = value
    for name, halves in gate_up.items():
        out[name] = torch.cat([halves["w1"], halves["w3"]], dim=1)
    return config, out

"""model.lora: low-rank adapters on named projections over a frozen base (LoRA, Hu et al.
2021; QLoRA, Dettmers et al. 2023, with model.lora.base_dtype=nf4).

Each targeted nn.Linear becomes a `LoRALinear`: the same module path, its weight (and
bias) under their own names and frozen, plus `lora_A` (r x in, drawn normal(0, 1/r), PEFT's
"gaussian" init) and `lora_B` (out x r, zeros), so the model starts as the base and
y = W x + (alpha / r) B A dropout(x). The adapters are applied on the meta-device
structure before any recipe parallelizes it (launcher.models.skeleton), so FSDP units,
ZeRO-3 partitions and checkpoints see them as ordinary parameters; the base weights keep
the names model.pretrained's files use, so they are read as before, and the adapters are
drawn from train.seed like any parameter (launcher/models/init.py).

Names: a parameter `<module>.lora_A.weight` here is PEFT's `base_model.model.<module>.
lora_A.weight` in adapter_model.safetensors (peft_state), so `PeftModel.from_pretrained`
loads an export over the untouched base (launcher/launch/commands/export.py).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from launcher.config import Config, LoraBase, LoraConfig
from launcher.models.init import InitSpec

ADAPTERS = ("lora_A", "lora_B")
PEFT_PREFIX = "base_model.model."


def is_adapter(name: str) -> bool:
    """A parameter of an adapter (trained), by its name."""
    return any(f".{a}." in f".{name}" for a in ADAPTERS)


class LoRALinear(nn.Linear):
    """An nn.Linear (tensor-parallel plans and isinstance checks still see one) whose frozen
    weight may be an NF4 tensor, plus its adapters."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        nn.Module.__init__(self)  # not nn.Linear's: the base's parameters are kept, nothing allocated twice
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        device = base.weight.device
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=device, dtype=torch.float32)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=device, dtype=torch.float32)
        self.scaling = alpha / rank
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_nf4(self.weight):
            from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4  # local: optional (torchao)

            out = linear_nf4(x, self.weight)
            out = out if self.bias is None else out + self.bias
        else:
            out = F.linear(x, self.weight, self.bias)
        return out + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


def is_nf4(t: torch.Tensor) -> bool:
    return type(t).__name__ == "NF4Tensor"


def targets(model: nn.Module, layers: str, names: list | None) -> list[str]:
    """The full names of the linears to adapt: inside the decoder layers (`layers`, the
    Layout's ModuleList), every nn.Linear, or those whose last name part is in `names`."""
    wanted = None if names is None else {str(n) for n in names}
    return [
        f"{layers}.{name}"
        for name, mod in model.get_submodule(layers).named_modules()
        if isinstance(mod, nn.Linear)
        and not isinstance(mod, LoRALinear)
        and (wanted is None or name.rsplit(".", 1)[-1] in wanted)
    ]


def inject(model: nn.Module, lora: LoraConfig, layers: str, base_dtype: torch.dtype | None) -> list[str]:
    """Adapters on the targeted linears of `model` (on the meta device, or under
    deepspeed.zero.Init), every other parameter frozen, and the frozen ones (not yet
    partitioned: `base_dtype` None under zero.Init, where DeepSpeed's dtype rules) cast to
    `base_dtype`. Returns the adapted modules' names."""
    names = targets(model, layers, lora.targets)
    for name in names:
        model.set_submodule(name, LoRALinear(model.get_submodule(name), lora.rank, lora.alpha, lora.dropout))
    for pname, p in model.named_parameters():
        p.requires_grad_(is_adapter(pname))
    if base_dtype is not None:
        cast_frozen(model, base_dtype)
    return names


def cast_frozen(model: nn.Module, dtype: torch.dtype) -> None:
    """The frozen floating parameters in `dtype` (meant for the meta device: free), ties kept."""
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
                if id(p) not in new:
                    new[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=False)
                module._parameters[name] = new[id(p)]


def base_dtype(cfg: Config) -> torch.dtype:
    """What the frozen weights are held in before any quantization (model.lora.base_dtype)."""
    choice = cfg.model.lora.base_dtype
    if choice == LoraBase.fp32:
        return torch.float32
    if choice == LoraBase.bf16:
        return torch.bfloat16
    precision = cfg.precision.name.value
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)


@torch.no_grad()
def quantize_base(model: nn.Module) -> None:
    """model.lora.base_dtype=nf4: each adapted linear's frozen weight, materialized, replaced
    by its NF4 tensor (torchao; blocks of 64, their scales quantized in blocks of 256).
    The model is first materialized whole in the base dtype: start-up holds 2 bytes a
    base parameter (launcher/planner counts it)."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4  # local: optional (torchao)

    for module in model.modules():
        if isinstance(module, LoRALinear) and not is_nf4(module.weight):
            blocks = module.weight.numel() // NF4_BLOCK
            if module.weight.numel() % NF4_BLOCK:
                continue  # not whole blocks of 64 (never in a real model's projections): kept as it is
            scaler_block = 256  # QLoRA's; a smaller power of two where the blocks do not divide by it (tiny models)
            while blocks % scaler_block:
                scaler_block //= 2
            module.weight = nn.Parameter(to_nf4(module.weight.detach(), NF4_BLOCK, scaler_block), requires_grad=False)


NF4_BLOCK = 64


def init_specs(model: nn.Module, rank: int) -> dict:
    """InitSpec of every adapter: A normal(0, 1/r) (PEFT's init_lora_weights="gaussian"),
    B zeros: the adapted model starts equal to its base."""
    return {
        name: InitSpec(std=1.0 / rank) if ".lora_A." in f".{name}" else InitSpec("zeros")
        for name, _ in model.named_parameters()
        if is_adapter(name)
    }


def adapters(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if is_adapter(k)}


def plain(cfg: Config) -> Config:
    """The same config without adapters: the base model."""
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora=LoraConfig()))


# ----------------------------------------------------------------------------- PEFT
def peft_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters under PEFT's names (adapter_model.safetensors: the adapter name 'default'
    is not in the file)."""
    return {PEFT_PREFIX + k: v.contiguous() for k, v in adapters(state).items()}


def peft_config(cfg: Config, adapted: list[str]) -> dict:
    """adapter_config.json: what peft.PeftModel.from_pretrained reads."""
    lora = cfg.model.lora
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(cfg.model.pretrained),
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted({n.rsplit(".", 1)[-1] for n in adapted}),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": "gaussian",
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }


def write_peft(cfg: Config, state: dict[str, torch.Tensor], out: Path, dtype: torch.dtype) -> Path:
    adapted = sorted({k.rsplit(".lora_", 1)[0] for k in adapters(state)})
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.to(dtype) for k, v in peft_state(state).items()},
        str(out / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    (out / "adapter_config.json").write_text(json.dumps(peft_config(cfg, adapted), indent=2) + "\n")
    return out


def merged(cfg: Config, state: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base's weights (`base`: the model built from plain(cfg)) with each adapter of
    `state` merged in (W + alpha/r B A, in fp32): the plain model's names, nothing of LoRA."""
    scale = cfg.model.lora.alpha / cfg.model.lora.rank
    out = {k: v.float() for k, v in base.items()}
    for key in adapters(state):
        if ".lora_A." not in f".{key}":
            continue
        module = key.rsplit(".lora_A.", 1)[0]
        a, b = state[key].float(), state[f"{module}.lora_B.weight"].float()
        out[f"{module}.weight"] = out[f"{module}.weight"] + scale * (b @ a)
    return out

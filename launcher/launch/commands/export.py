"""Export: consolidated weights from any recipe's checkpoint, on one process, no GPU.

`export.format=hf` writes a folder `AutoModelForCausalLM.from_pretrained` loads instead
(launcher.models.hf_export.save_pretrained; the project's decoder as LlamaForCausalLM).

Each recipe module provides `consolidate(cfg, engine_dir) -> {name: fp32 tensor}` that
reads its own checkpoint layout (DDP's single file, DeepSpeed's shards, DCP). This module
picks the checkpoint, casts, and writes safetensors with the model config in the
metadata, so `load_exported(path)` rebuilds the project's model from the file alone.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

import engines
from launcher import config as C
from launcher import models
from launcher.launch.checks.levers import base_digest
from launcher.launch.compose import UsageError
from launcher.launch.start.supervise import interrupts_held
from launcher.manifest import find_latest, root_of, step_name, verify
from launcher.untrusted import check_checkpoint


def cmd_export(args: list[str]) -> int:
    """`launcher export RUN_DIR [export.key=value ...]`: consolidated weights."""
    if not args or "=" in args[0]:
        raise UsageError(
            "usage: launcher export RUN_DIR [export.format=safetensors export.dtype=fp32|bf16 "
            "export.step=N export.out=DIR]"
        )
    run_dir = Path(args[0]).resolve()
    if not (run_dir / "config.yaml").is_file():
        raise C.ConfigError("RUN", args[0], "not a run directory (no config.yaml in it)")
    for o in args[1:]:
        if not o.startswith("export."):
            raise C.ConfigError(o.split("=", 1)[0], o.split("=", 1)[-1], "export takes only export.* options")
    out = export(run_dir, args[1:])
    dtype = next((o.split("=", 1)[1] for o in args[1:] if o.startswith("export.dtype=")), "fp32")
    print(f"exported {out} ({dtype})")
    return 0


def export(run_dir: Path, overrides: list[str]) -> Path:
    """The checkpoint RUN_DIR's config and `overrides` name, consolidated and written as
    safetensors, a PEFT folder (model.lora, unmerged) or a from_pretrained folder."""
    with interrupts_held():  # the launch side imports torch only when it exports (test_imports)
        import torch  # local: torch (launch side)
        from safetensors.torch import save_file  # local: torch (launch side)

    cfg = export_config(run_dir, overrides)
    folder = chosen_checkpoint(cfg, run_dir)
    state = engines.consolidate(cfg, folder / "engine")
    dtype = {C.ExportDtype.fp32: torch.float32, C.ExportDtype.bf16: torch.bfloat16}[cfg.export.dtype]
    # Each dtype has its own default folder: a bf16 export never replaces the fp32 one.
    suffix = "" if cfg.export.dtype == C.ExportDtype.fp32 else f"-{cfg.export.dtype.value}"
    if cfg.model.lora.rank > 0:  # the checkpoint holds the adapters: alone as PEFT's folder, or merged
        from launcher.models import lora  # local: torch (launch side)

        if not cfg.export.merge_lora:
            out = Path(cfg.export.out) if cfg.export.out else run_dir / "export" / f"{folder.name}-peft{suffix}"
            return readable(lora.write_peft(cfg, state, out, dtype))
        same_base(cfg, folder)
        base = models.build(lora.plain(cfg), torch.device("cpu")).state_dict()  # model.pretrained, read again
        state = lora.merged(cfg, state, base)
        suffix = f"-merged{suffix}"
    if cfg.export.format == C.ExportFormat.hf:  # a from_pretrained folder (launcher/models/hf.py)
        from launcher.models.hf_export import save_pretrained  # local: torch (launch side)

        out = Path(cfg.export.out) if cfg.export.out else run_dir / "export" / f"{folder.name}-hf{suffix}"
        return readable(save_pretrained(cfg, state, out, dtype))
    # Tied weights share storage; safetensors stores each name as its own tensor.
    tensors = {k: v.detach().to(dtype).contiguous().clone() for k, v in state.items()}
    out = Path(cfg.export.out) if cfg.export.out else run_dir / "export" / f"{folder.name}{suffix}"
    out.mkdir(parents=True, exist_ok=True)
    path = out / "model.safetensors"
    meta = {
        "format": "launcher",
        "step": folder.name,
        "recipe": cfg.recipe.name,
        "model": json.dumps(OmegaConf.to_container(OmegaConf.structured(cfg.model), enum_to_str=True)),
    }
    save_file(tensors, str(path), metadata=meta)
    return readable(path)


def export_config(run_dir: Path, overrides: list[str]) -> C.Config:
    """The run's frozen config with the command line's export.* on top (export.out only
    from the command line, never from a run directory's file)."""
    base = OmegaConf.merge(OmegaConf.structured(C.Config), C.read_frozen(run_dir / "config.yaml"))
    base.export.out = None
    cfg: C.Config = C.to_typed(OmegaConf.merge(base, OmegaConf.from_dotlist(overrides)))
    if cfg.model.kind == C.ModelKind.hf and cfg.export.format != C.ExportFormat.hf:
        raise C.ConfigError(
            "export.format", cfg.export.format.value, "model=hf exports as export.format=hf (a from_pretrained folder)"
        )
    return cfg


def chosen_checkpoint(cfg: C.Config, run_dir: Path) -> Path:
    """export.step's checkpoint folder (default: the newest complete one), whole and data."""
    root = root_of(cfg, run_dir)
    if cfg.export.step is None:
        folder = find_latest(root)
        if folder is None:
            raise C.ConfigError("RUN", str(run_dir), f"no complete checkpoint under {root}")
    else:
        folder = root / step_name(cfg.export.step)
        problem = verify(folder) if folder.is_dir() else "no such checkpoint"
        if problem:
            raise C.ConfigError("export.step", cfg.export.step, f"{folder}: {problem}")
    problem = check_checkpoint(folder)
    if problem:
        raise C.ConfigError("RUN", str(run_dir), problem)
    return folder


def same_base(cfg: C.Config, folder: Path) -> None:
    """export.merge_lora: model.pretrained is still the base the adapters were trained over
    (its sha256 against the checkpoint's manifest), or a merge would write another model."""
    from launcher.data.cache import cache_root  # local: start-up (numpy, 0.75 s, launch side)

    manifest = json.loads((folder / "manifest.json").read_text())
    recorded = ((manifest.get("model") or {}).get("lora") or {}).get("base_digest")
    here = base_digest(cfg.model.pretrained, cache_root(cfg.data))
    if recorded and recorded != here:
        raise C.ConfigError(
            "model.pretrained",
            cfg.model.pretrained,
            f"{folder} holds adapters trained over another "
            f"base (sha256 {recorded[:12]}... there, {here[:12]}... here): merged into this one they "
            "would make another model; give the base they were trained on",
        )


def readable(path: Path) -> Path:
    """Exported files get the mode of any file this user creates (safetensors writes 0600):
    weights are meant to be shared, the umask decides with whom."""
    mask = os.umask(0)
    os.umask(mask)
    for f in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        f.chmod(0o666 & ~mask)
    return path


def load_exported(path: str | Path, device: str = "cpu"):
    """The project's model (launcher.models.gpt.GPT) with the exported weights, from the
    file alone."""
    import torch  # local: torch (launch side)
    from safetensors import safe_open  # local: torch (launch side)

    from launcher.models.gpt import GPT  # local: torch (launch side)

    with safe_open(str(path), framework="pt", device=device) as f:
        meta = f.metadata()
        state = {k: f.get_tensor(k) for k in f.keys()}
    model_cfg: Any = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(C.ModelConfig), json.loads(meta["model"]))
    )
    with torch.device(device):
        model = GPT(model_cfg)
    model.load_state_dict({k: v.float() for k, v in state.items()})
    return model

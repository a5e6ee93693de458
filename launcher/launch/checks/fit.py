"""Does the checkpoint a launch would resume load into the model and recipe it builds?

Answered on the launch side, before any rank starts, from what every checkpoint's
manifest records (`model`: the model section of the config that wrote it; `params`: the
full model's parameter names and shapes, from its meta-device build) and from the engine
files on disk. A launch into a run directory whose checkpoints hold another shape, another
vocabulary or a format the recipe cannot read is refused in one line naming what differs,
instead of five rank tracebacks (`size mismatch for tok_embeddings.weight`).
"""

from __future__ import annotations

import json
from pathlib import Path

import engines
from launcher import config as C
from launcher.manifest import MANIFEST, resumable, shapes

FORMATS = [  # (format, file that marks it, its name)
    ("ddp", "engine/model.pt", "a ddp checkpoint (engine/model.pt)"),
    ("dcp", "engine/.metadata", "a distributed checkpoint (DCP: fsdp, tp, tp_fsdp, pp)"),
    ("deepspeed", "engine/zero.json", "a DeepSpeed checkpoint (zero1/2/3)"),
]


def readers(fmt: str) -> set[str]:
    """The engines that load a checkpoint of this format (their EngineSpec's `reads`)."""
    return {name for name, spec in engines.specs().items() if fmt in spec.reads}


def check(cfg: C.Config, run_dir: Path) -> None:
    """ConfigError (one line) when the checkpoint this launch resumes cannot load here."""
    folders = resumable(cfg, run_dir)
    if not folders:
        return
    folder = folders[-1]
    key, value = "checkpoint.resume", cfg.checkpoint.resume
    out = (
        "use another hydra.run.dir for a new run, or checkpoint.resume=never checkpoint.on_existing=archive "
        "to start over here (the old run is kept)"
    )
    for fmt, marker, name in FORMATS:
        can = readers(fmt)
        if (folder / marker).exists() and cfg.recipe.engine not in can:
            raise C.ConfigError(
                key,
                value,
                f"{folder} is {name}, which recipe={cfg.recipe.name} cannot load; "
                f"resume it with a recipe whose engine is {'/'.join(sorted(can))}, "
                f"or {out}",
            )
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return  # the ranks' own check names it
    old = manifest.get("params") if isinstance(manifest, dict) else None
    check_base(cfg, folder, manifest, out)
    if not isinstance(old, dict):
        return  # written before manifests recorded the model: nothing to compare
    new = shapes(cfg)
    if old == new:
        return
    differ = [n for n in sorted(old.keys() | new.keys()) if old.get(n) != new.get(n)]
    first = differ[0]
    example = f"{first} {_shape(old.get(first))} there, {_shape(new.get(first))} here"
    keys = _changed(manifest.get("model") or {}, C.to_dict(cfg)["model"], "model")
    what = ", ".join(f"{k}={a} there, {b} here" for k, a, b in keys) or "the same model.* keys, other model files"
    raise C.ConfigError(
        key,
        value,
        f"{folder} holds another model ({what}; {len(differ)} of "
        f"{len(old.keys() | new.keys())} tensors differ, e.g. {example}); "
        f"set the keys back to continue it, or {out}",
    )


def check_base(cfg: C.Config, folder: Path, manifest, out: str) -> None:
    """model.lora: the adapters of `folder` were trained over the base this launch reads
    (model.pretrained's sha256, launcher/models/lora.py::base_digest)."""
    lora = ((manifest.get("model") or {}).get("lora") or {}) if isinstance(manifest, dict) else {}
    old, new = lora.get("base_digest") if isinstance(lora, dict) else None, cfg.model.lora.base_digest
    if old and new and old != new:
        raise C.ConfigError(
            "model.pretrained",
            cfg.model.pretrained,
            f"{folder} holds adapters trained over another "
            f"base (sha256 {old[:12]}... there, {new[:12]}... here); give the base they were trained "
            f"on to continue, or {out}",
        )


def _shape(s) -> str:
    return "absent" if s is None else "[" + ", ".join(map(str, s)) + "]"


def _changed(old: dict, new: dict, prefix: str) -> list[tuple[str, object, object]]:
    out = []
    for k in sorted(old.keys() | new.keys()):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _changed(a, b, f"{prefix}.{k}")
        elif a != b:
            out.append((f"{prefix}.{k}", a, b))
    return out

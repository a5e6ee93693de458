"""What the user asked for, told apart from what a default gave (launch side, before any
rank starts): a data key of a source the run does not read (refused: `data.files=...`
without data=hf_text would train on synthetic data); the default precision on a CPU that
has no native bf16 (fp32, said once); a relaunch into a run directory, which keeps what the
run trains (its model, data, precision and global batch) unless the overrides change it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from launcher import config as C
from launcher.host import native_bf16
from launcher.manifest import resumable
from launcher.parallel.degrees import data_parallel_size, global_batch

KEPT = ("model", "data", "precision", "train.micro_batch", "train.grad_accum", "train.global_batch", "train.seq_len")
"""What a run trains: a relaunch takes these from the run's config.yaml unless it names them
(a key, or its group: `model=gpt_small`), not from the defaults of conf/."""


def named(overrides: list[str]) -> set[str]:
    """The keys (and groups) the overrides name: `data=hf_text` names data,
    `+data.files=...` data.files."""
    return {o.split("=", 1)[0].lstrip("+~") for o in overrides if not o.startswith("-")}


def is_named(key: str, names: set[str]) -> bool:
    """`key` or a group above it named: `model=gpt_small` names model.dim."""
    parts = key.split(".")
    return any(".".join(parts[:i]) in names for i in range(1, len(parts) + 1))


def check_data_keys(cfg: C.Config, names: set[str]) -> None:
    """A data.* key that the run's data= does not read, named or set away from its default:
    ConfigError naming the source that reads it."""
    d, default = cfg.data, C.DataConfig()
    for key, readers in C.SOURCE_KEYS.items():
        value = getattr(d, key)
        if d.name in readers or not (f"data.{key}" in names or value != getattr(default, key)):
            continue
        which = " or ".join(f"data={r.value}" for r in readers)
        chosen = "chosen" if "data" in names else "the default"
        raise C.ConfigError(
            f"data.{key}",
            getattr(value, "value", value),
            f"read by {which} only, but this run's data is {d.name.value} ({chosen}): add "
            f"{which.split(' or ')[0]} to train on it, or leave data.{key} out",
        )


def fit_precision(cfg: C.Config, names: set[str], host, native: bool | None = None) -> tuple[C.Config, str | None]:
    """The default precision (bf16) on ranks of a CPU without native bf16 (`native`, else
    this CPU's flags: host.native_bf16): fp32, and the line that says so. A precision the
    user chose is kept."""
    p = cfg.precision
    if host.cuda or is_named("precision.name", names) or p.name != C.Precision.bf16 or p.fp8:
        return cfg, None
    if native_bf16() if native is None else native:
        return cfg, None
    note = (
        "precision=fp32: this CPU has no native bf16 (no AVX-512 BF16 or AMX), where bf16 runs several times "
        "slower than fp32; precision=bf16 to have it anyway"
    )
    return dataclasses.replace(cfg, precision=dataclasses.replace(p, name=C.Precision.fp32)), note


def keep_run_values(cfg: C.Config, names: set[str], run_dir: Path, host) -> tuple[C.Config, str | None, set[str]]:
    """A launch that resumes a run (its config.yaml and a checkpoint to resume): the KEPT
    values the overrides do not name are the run's own, and its global batch is kept at a new
    world size (train.global_batch) unless the overrides set the batch. Returns the config,
    one line naming what was kept and what the overrides change (None: nothing), and the
    keys the run settled (KEPT when it resumes: no default, such as fit_precision's, applies)."""
    frozen = run_dir / "config.yaml"
    if not frozen.is_file() or not resumable(cfg, run_dir):
        return cfg, None, set()
    old = C.load_frozen(frozen)
    new_d, old_d = C.to_dict(cfg), C.to_dict(old)
    kept, changed = [], []
    for key in KEPT:
        for leaf, was, now in _differ(_get(old_d, key), _get(new_d, key), key):
            if is_named(leaf, names):
                changed.append(f"{leaf}={_plain(now)} (was {_plain(was)})")
            else:
                _set(new_d, leaf, was)
                kept.append(f"{leaf}={_plain(was)}")
    cfg = C.to_typed(new_d) if kept else cfg
    cfg, batch = _keep_global_batch(cfg, old, names, host)
    words = (
        ([f"the run's own {', '.join(_grouped(kept))}"] if kept else [])
        + ([f"changed by this launch: {', '.join(changed)}"] if changed else [])
        + ([batch] if batch else [])
    )
    line = f"{run_dir} resumes its run with {'; '.join(words)} (name a key to change it)" if words else None
    return cfg, line, set(KEPT)


def _keep_global_batch(cfg: C.Config, old: C.Config, names: set[str], host) -> tuple[C.Config, str | None]:
    """At another world size (a reshard) the run's global batch, through train.global_batch,
    unless the overrides set train.global_batch or train.grad_accum; where it cannot be kept,
    the line says so."""
    worlds = [C.nproc_per_node(c, host) * c.cluster.nnodes for c in (old, cfg)]
    was, now = global_batch(old, worlds[0]), global_batch(cfg, worlds[1])
    if was == now:
        return cfg, None
    if names & {"train.global_batch", "train.grad_accum", "train"}:
        return cfg, f"a global batch of {now} samples (was {was})"
    per_step = cfg.train.micro_batch * data_parallel_size(cfg, worlds[1])
    if was % per_step:
        return cfg, (
            f"a global batch of {now} samples instead of the run's {was}: {was} is not a multiple of "
            f"micro_batch x data-parallel size = {per_step} at {worlds[1]} process(es); set train.global_batch"
        )
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch=was))
    return cfg, f"its global batch of {was} samples at {worlds[1]} process(es) (train.global_batch={was})"


def _get(d: dict, key: str):
    for part in key.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def _set(d: dict, key: str, value) -> None:
    *path, leaf = key.split(".")
    for part in path:
        d = d[part]
    d[leaf] = value


def _differ(a, b, prefix: str) -> list[tuple[str, object, object]]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [x for k in sorted(a.keys() | b.keys()) for x in _differ(a.get(k), b.get(k), f"{prefix}.{k}")]
    return [] if a == b else [(prefix, a, b)]


def _grouped(kept: list[str]) -> list[str]:
    """`model=gpt_small` for the keys of a group whose option (its name) was kept."""
    groups = {k.split("=", 1)[0].rsplit(".", 1)[0] for k in kept if k.split("=", 1)[0].endswith(".name")}
    out = [k.replace(".name=", "=") for k in kept if k.split("=", 1)[0].endswith(".name")]
    return out + [k for k in kept if k.split("=", 1)[0].rsplit(".", 1)[0] not in groups]


def _plain(value) -> str:
    return "null" if value is None else str(value)

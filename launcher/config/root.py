"""The whole config (`Config`: one field per group), its registration with Hydra's
ConfigStore, and its conversions (an OmegaConf node, config.yaml, a dict).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, cast

from omegaconf import DictConfig, OmegaConf

from launcher.config.model import DataConfig, ModelConfig
from launcher.config.recipe import ParallelConfig, RecipeConfig
from launcher.config.run import (
    CheckpointConfig,
    ClusterConfig,
    DebugConfig,
    ExportConfig,
    LoggerConfig,
    PlanConfig,
    ProfileConfig,
)
from launcher.config.train import DistConfig, OptimConfig, PrecisionConfig, TrainConfig


@dataclass
class Config:
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    run_name: Optional[str] = None
    """Name shown in W&B and the console (null: the run directory's name; a sweep's point:
    its swept values, e.g. `optim.lr=0.001`)."""


GROUPS = {
    "recipe": RecipeConfig,
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "precision": PrecisionConfig,
    "checkpoint": CheckpointConfig,
    "logger": LoggerConfig,
    "cluster": ClusterConfig,
    "train": TrainConfig,
    "parallel": ParallelConfig,
}


def register_configs() -> None:
    """Register the schema so `conf/config.yaml` (defaults: `- schema`) is typed. Hydra is
    imported here, by the launch side's composition: the ranks read config.yaml without it."""
    from hydra.core.config_store import ConfigStore  # local: start-up (hydra, 0.5 s)

    cs = ConfigStore.instance()
    cs.store(name="schema", node=Config)


RETIRED = ("dry_run",)
"""Top-level keys config.yaml held in earlier versions and no longer does (dry_run is a
flag now): dropped when a frozen config is read, so a run directory made before still
resumes (command.sh, a requeued job, export)."""


RENAMED = {"recipe.strategy": "recipe.engine"}
"""Keys with a new name, old -> new. recipe.strategy was a third word for the engine a recipe
runs (issue 50: a recipe is what a user picks, an engine the code that runs it). A frozen
config written before holds the old key: read_frozen translates it, so a run directory made
then still resumes; on the command line the old key is refused in one line that names the
new one (launcher/launch/compose.py)."""


def to_typed(cfg_node) -> Config:
    """An OmegaConf node (composed or loaded) to dataclasses with Enums."""
    merged = OmegaConf.merge(OmegaConf.structured(Config), cfg_node)
    return cast(Config, OmegaConf.to_object(merged))


def read_frozen(path: Path):
    """RUN_DIR/config.yaml as an OmegaConf node, less the RETIRED keys, the RENAMED ones
    under their new names."""
    node = cast(DictConfig, OmegaConf.load(path))  # a YAML mapping
    for key in RETIRED:
        node.pop(key, None)
    for old, new in RENAMED.items():
        _rename(node, old, new)
    return node


def _rename(node: DictConfig, old: str, new: str) -> None:
    """Move the value at dotted key `old` to `new` (a run directory written before the
    rename); the new key wins where a file holds both."""
    parent, _, leaf = old.rpartition(".")
    group = OmegaConf.select(node, parent) if parent else node
    if not isinstance(group, DictConfig) or leaf not in group:
        return
    value = group.pop(leaf)
    if OmegaConf.select(node, new) is None:
        OmegaConf.update(node, new, value, merge=False)


def load_frozen(path: str | Path) -> Config:
    """The rank side: read RUN_DIR/config.yaml (or a path to it)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.yaml"
    return to_typed(read_frozen(p))


def write_frozen(run_dir: Path, cfg: Config) -> None:
    """Replace RUN_DIR/config.yaml whole (a reader never sees half of it): a back-off
    (train.oom_backoff) records its micro-batch there, by the launcher or by the rank."""
    tmp = run_dir / "config.yaml.tmp"
    tmp.write_text(to_yaml(cfg))
    os.replace(tmp, run_dir / "config.yaml")


def to_yaml(cfg: Config) -> str:
    """config.yaml's text. Every string is written as its characters: a `${` in a value
    (a user's escaped `\\${...}`, a path that holds one) is escaped, so no reader of the file
    (the ranks, export, a relaunch) resolves it against its own environment. The project's
    own interpolations (hydra.run.dir's ${now:}) were resolved on the launch side before."""
    return OmegaConf.to_yaml(
        OmegaConf.create(_escaped(OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)))
    )


_INTERPOLATION = re.compile(r"(\\*)\$\{")


def _escaped(value):
    """OmegaConf's escapes for every string in `value`: `${` -> `\\${` (backslashes before it
    doubled), which reads back as the characters written."""
    if isinstance(value, str):
        return _INTERPOLATION.sub(lambda m: m.group(1) * 2 + "\\${", value)
    if isinstance(value, dict):
        return {k: _escaped(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_escaped(v) for v in value]
    return value


def to_dict(cfg: Config) -> dict:
    return cast(dict, OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True))

"""Typed configuration: one dataclass per Hydra group, registered in the ConfigStore.

Every option is documented where it is declared, with its trade-off. The YAML files in
`conf/` only choose values; the types, defaults and allowed values live here, so Hydra
refuses unknown keys and wrong types while composing. `from launcher import config as C`
gives every name of the package (C.Config, C.Strategy, C.degrees ...).

    enums.py    the allowed values of every choice, ConfigError
    recipe.py   recipe.*, parallel.*
    model.py    model.*, data.*
    train.py    train.*, optim.*, precision.*, dist.*
    run.py      checkpoint.*, logger.*, cluster.*, debug.*, profile.*, export.*, plan.*
    root.py     Config, its registration and conversions (config.yaml)
    derived.py  degrees, batch arithmetic, figures derived from a config

The cross-field checks that no single type can express (batch arithmetic, device
capabilities, paths, the model's shape) are launcher/validate.py's. This package imports
nothing else of the project.
"""

from __future__ import annotations

from launcher.config.enums import (ACMode, Backend, ConfigError, DataKind, ExportDtype, ExportFormat, FaultPoint,
                                   HFAttention, LoggerKind, ModelKind, OffloadDevice, OnExisting, PPSchedule,
                                   Precision, Runner, Scheduler, Strategy, TextFormat, TokenDtype, WandbMode)
from launcher.config.recipe import DDPOptions, FSDPOptions, ParallelConfig, RecipeConfig, ZeroOptions
from launcher.config.model import DataConfig, ModelConfig
from launcher.config.train import DistConfig, OptimConfig, PrecisionConfig, TrainConfig
from launcher.config.run import (CheckpointConfig, ClusterConfig, DebugConfig, ExportConfig, LoggerConfig, PlanConfig,
                                 ProfileConfig)
from launcher.config.root import (Config, GROUPS, RETIRED, load_frozen, read_frozen, register_configs, to_dict,
                                  to_typed, to_yaml)
from launcher.config.derived import (RECIPE_PARALLELISM, STRATEGIES, Degrees, Parallelism, StrategySpec,
                                     data_parallel_size, degrees, ffn_dim, global_batch, grad_accum, nproc_per_node,
                                     pipeline_stages)

__all__ = [
    "ACMode", "Backend", "ConfigError", "DataKind", "ExportDtype", "ExportFormat", "FaultPoint", "HFAttention",
    "LoggerKind", "ModelKind", "OffloadDevice", "OnExisting", "PPSchedule", "Precision", "Runner", "Scheduler",
    "Strategy", "TextFormat", "TokenDtype", "WandbMode", "DDPOptions", "FSDPOptions", "ParallelConfig",
    "RecipeConfig", "ZeroOptions", "DataConfig", "ModelConfig", "DistConfig", "OptimConfig", "PrecisionConfig",
    "TrainConfig", "CheckpointConfig", "ClusterConfig", "DebugConfig", "ExportConfig", "LoggerConfig", "PlanConfig",
    "ProfileConfig", "Config", "GROUPS", "RETIRED", "read_frozen", "load_frozen", "register_configs", "to_dict",
    "to_typed", "to_yaml", "STRATEGIES", "StrategySpec", "Degrees", "Parallelism", "RECIPE_PARALLELISM",
    "data_parallel_size", "degrees", "ffn_dim", "global_batch", "grad_accum", "nproc_per_node", "pipeline_stages",
]

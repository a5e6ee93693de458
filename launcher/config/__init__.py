"""Typed configuration: one dataclass per Hydra group, registered in the ConfigStore.

Every option is documented where it is declared, with its trade-off. The YAML files in
`conf/` only choose values; the types, defaults and allowed values live here, so Hydra
refuses unknown keys and wrong types while composing. `from launcher import config as C`
gives every name of the package (C.Config, C.Precision, C.ffn_dim ...).

    enums.py    the allowed values of every choice, ConfigError
    recipe.py   recipe.*, parallel.*
    model.py    model.*, data.*
    moe.py      model.moe.* (mixture of experts)
    train.py    train.*, optim.*, precision.*, dist.*
    run.py      checkpoint.*, logger.*, cluster.*, debug.*, profile.*, export.*, plan.*
    root.py     Config, its registration and conversions (config.yaml)
    derived.py  figures derived from a config alone (the degrees and batch arithmetic, which
                need the recipe's engine: launcher/parallel/degrees.py)

The cross-field checks that no single type can express (batch arithmetic, device
capabilities, paths, the model's shape) are launcher/launch/checks/validate.py's. This package imports
nothing else of the project.
"""

from __future__ import annotations

from launcher.config.derived import (
    attention_params,
    block_matmul_params,
    expert_dim,
    ffn_dim,
    ffn_params,
    from_shape_key,
    head_dim,
    held_out_windows,
    is_moe_block,
    loss_chunks,
    lr_factor,
    matmul_params,
    nproc_per_node,
    num_params,
    pipeline_stages,
    shape_key,
    shared_dim,
    sliceable_loss,
)
from launcher.config.enums import (
    ACMode,
    Backend,
    ConfigError,
    DataKind,
    ExportDtype,
    ExportFormat,
    FaultPoint,
    HFAttention,
    K8sKind,
    LoggerKind,
    LoraBase,
    ModelKind,
    OffloadDevice,
    OnExisting,
    PPSchedule,
    Precision,
    Runner,
    Scheduler,
    TextFormat,
    TokenDtype,
    TrainOn,
    WandbMode,
)
from launcher.config.model import SOURCE_KEYS, DataConfig, LoraConfig, ModelConfig
from launcher.config.moe import MoEBalance, MoEConfig, MoEScore
from launcher.config.recipe import DDPOptions, FSDPOptions, ParallelConfig, RecipeConfig, ZeroOptions
from launcher.config.root import (
    GROUPS,
    RENAMED,
    RETIRED,
    Config,
    load_frozen,
    read_frozen,
    register_configs,
    to_dict,
    to_typed,
    to_yaml,
    write_frozen,
)
from launcher.config.run import (
    CheckpointConfig,
    ClusterConfig,
    DebugConfig,
    ExportConfig,
    K8sConfig,
    LoggerConfig,
    PlanConfig,
    ProfileConfig,
)
from launcher.config.train import DistConfig, OptimConfig, PrecisionConfig, TrainConfig

__all__ = [
    "ACMode",
    "Backend",
    "ConfigError",
    "DataKind",
    "ExportDtype",
    "ExportFormat",
    "FaultPoint",
    "HFAttention",
    "K8sKind",
    "LoggerKind",
    "LoraBase",
    "ModelKind",
    "OffloadDevice",
    "OnExisting",
    "PPSchedule",
    "Precision",
    "Runner",
    "Scheduler",
    "TextFormat",
    "TokenDtype",
    "TrainOn",
    "WandbMode",
    "DDPOptions",
    "FSDPOptions",
    "ParallelConfig",
    "RecipeConfig",
    "ZeroOptions",
    "DataConfig",
    "LoraConfig",
    "ModelConfig",
    "SOURCE_KEYS",
    "DistConfig",
    "OptimConfig",
    "PrecisionConfig",
    "TrainConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "K8sConfig",
    "DebugConfig",
    "ExportConfig",
    "LoggerConfig",
    "PlanConfig",
    "ProfileConfig",
    "Config",
    "GROUPS",
    "RENAMED",
    "RETIRED",
    "read_frozen",
    "load_frozen",
    "register_configs",
    "to_dict",
    "to_typed",
    "to_yaml",
    "write_frozen",
    "ffn_dim",
    "block_matmul_params",
    "matmul_params",
    "num_params",
    "lr_factor",
    "nproc_per_node",
    "pipeline_stages",
    "shape_key",
    "MoEBalance",
    "MoEConfig",
    "MoEScore",
    "attention_params",
    "expert_dim",
    "ffn_params",
    "from_shape_key",
    "head_dim",
    "is_moe_block",
    "shared_dim",
    "loss_chunks",
    "sliceable_loss",
    "held_out_windows",
]

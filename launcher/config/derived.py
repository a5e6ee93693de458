"""Figures derived from a config, shared by the launch side and the ranks: the
parallel degrees a recipe uses and their resolution on a world size, the batch arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.config.enums import PPSchedule, Strategy
from launcher.config.recipe import ParallelConfig
from launcher.config.model import ModelConfig
from launcher.config.root import Config


@dataclass(frozen=True)
class Parallelism:
    """What a recipe may split: data-parallel sharding, tensor parallel, pipeline."""

    shards: bool = False
    tp: bool = False
    pp: bool = False


@dataclass(frozen=True)
class StrategySpec:
    """What the rest of the launcher knows of a recipe.strategy: one row of STRATEGIES,
    read by the recipe registry (recipes.module), validation, the rank's build, the
    checkpoint fit check and the mesh. Its engine is `module` (build, consolidate)."""

    module: str
    """The engine's module (recipes/<name>.py), imported on first use."""
    parallelism: Parallelism = Parallelism()
    """The degrees it may use beyond data parallel (none: pure data parallel)."""
    builds_on_meta: bool = False
    """It shards the meta-device model, then each rank materializes only its part."""
    writes: str = "ddp"
    """Its checkpoint format: ddp (engine/model.pt), dcp (engine/.metadata), deepspeed."""
    reads: tuple[str, ...] = ("ddp",)
    """The formats its engine loads (DCP's loader reads ddp's files too)."""


STRATEGIES: dict[Strategy, StrategySpec] = {
    Strategy.ddp: StrategySpec("recipes.ddp", reads=("ddp", "dcp")),
    Strategy.fsdp: StrategySpec("recipes.fsdp", Parallelism(shards=True), True, "dcp", ("ddp", "dcp")),
    Strategy.tp: StrategySpec("recipes.tp", Parallelism(tp=True), True, "dcp", ("ddp", "dcp")),
    Strategy.tp_fsdp: StrategySpec("recipes.tp_fsdp", Parallelism(shards=True, tp=True), True, "dcp", ("ddp", "dcp")),
    Strategy.pp: StrategySpec("recipes.pp", Parallelism(pp=True), True, "dcp", ("ddp", "dcp")),
    Strategy.zero: StrategySpec("recipes.zero", writes="deepspeed", reads=("deepspeed",)),
}
"""Every recipe.strategy (conf/recipe/*.yaml chooses one): a new engine is its module, a
row here and its YAML; `make plan`'s candidates (launcher/plan.py) list the layouts."""

RECIPE_PARALLELISM = {s.value: spec.parallelism for s, spec in STRATEGIES.items() if spec.parallelism != Parallelism()}
"""The strategies that split more than the data (a device mesh), by name."""


@dataclass(frozen=True)
class Degrees:
    """The resolved degrees of one job; ranks are laid out row-major over
    (pp, dp_replicate, dp_shard, tp), the order of the device mesh's dimensions."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    def coords(self, rank: int) -> tuple[int, int, int, int]:
        """(pp, dp_replicate, dp_shard, tp) coordinates of a global rank."""
        rest, t = divmod(rank, self.tp)
        rest, s = divmod(rest, self.dp_shard)
        p, r = divmod(rest, self.dp_replicate)
        return p, r, s, t

    def dp_rank(self, rank: int) -> int:
        """Which slice of each global batch this rank's data-parallel group reads."""
        _, r, s, _ = self.coords(rank)
        return r * self.dp_shard + s


def degrees(cfg: Config, world_size: int) -> Degrees:
    """The degrees for this recipe at this world size. dp_shard=-1 takes the ranks the
    others leave; a recipe that does not shard replicates over them instead. Degrees a
    recipe does not use count as 1 (validate refuses them before a launch)."""
    p = cfg.parallel
    can = RECIPE_PARALLELISM.get(cfg.recipe.strategy.value, Parallelism())
    tp, pp = (p.tp if can.tp else 1), (p.pp if can.pp else 1)
    rest = p.dp_shard if p.dp_shard != -1 else max(1, world_size // max(1, p.dp_replicate * tp * pp))
    if can.shards:
        return Degrees(pp=pp, dp_replicate=p.dp_replicate, dp_shard=rest, tp=tp)
    return Degrees(pp=pp, dp_replicate=p.dp_replicate * rest, dp_shard=1, tp=tp)


def data_parallel_size(cfg: Config, world_size: int) -> int:
    """Ranks that see different data: world / (tp x pp)."""
    return degrees(cfg, world_size).dp


def grad_accum(cfg: Config, world_size: int) -> int:
    t = cfg.train
    if t.global_batch is None:
        return t.grad_accum
    return t.global_batch // (t.micro_batch * data_parallel_size(cfg, world_size))


def global_batch(cfg: Config, world_size: int) -> int:
    return cfg.train.micro_batch * grad_accum(cfg, world_size) * data_parallel_size(cfg, world_size)


def ffn_dim(m: ModelConfig) -> int:
    if m.ffn_dim is not None:
        return m.ffn_dim
    hidden = int(8 * m.dim / 3)
    return m.multiple_of * ((hidden + m.multiple_of - 1) // m.multiple_of)


def pipeline_stages(p: ParallelConfig) -> int:
    """Pipeline stages in all: pp, times the stages per rank of an interleaved schedule."""
    return p.pp * (p.pp_virtual_stages if p.pp_schedule == PPSchedule["interleaved_1f1b"] else 1)


def nproc_per_node(cfg: Config, host) -> int:
    c = cfg.cluster
    if c.nproc_per_node is not None:
        return c.nproc_per_node
    if c.gpus_per_node is not None:
        return c.gpus_per_node
    return host.gpus if host.cuda else 2

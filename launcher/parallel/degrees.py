"""The parallel degrees of a job and the batch arithmetic, read by both sides: what the
recipe's engine may split (its EngineSpec, engines/), resolved on a world size. Pure: no
torch, no process group."""

from __future__ import annotations

from dataclasses import dataclass

import engines
from launcher.config import Config


@dataclass(frozen=True)
class Degrees:
    """The resolved degrees of one job; ranks are laid out row-major over
    (pp, dp_replicate, dp_shard, cp, tp), the order of the device mesh's dimensions
    (torchtitan's): tensor-parallel ranks are neighbours, then the context-parallel ranks
    that share samples, then the data-parallel ones."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1
    """parallel.ep: the experts split over ep of the dp_shard x cp ranks (not a mesh
    dimension of its own: launcher/parallel/experts.py cuts those ranks in two)."""

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def coords(self, rank: int) -> tuple[int, int, int, int, int]:
        """(pp, dp_replicate, dp_shard, cp, tp) coordinates of a global rank."""
        rest, t = divmod(rank, self.tp)
        rest, c = divmod(rest, self.cp)
        rest, s = divmod(rest, self.dp_shard)
        p, r = divmod(rest, self.dp_replicate)
        return p, r, s, c, t

    def dp_rank(self, rank: int) -> int:
        """Which slice of each global batch this rank's data-parallel group reads (the ranks
        of a context-parallel group read the same samples)."""
        _, r, s, _, _ = self.coords(rank)
        return r * self.dp_shard + s

    def cp_rank(self, rank: int) -> int:
        """Which T/cp positions of its samples this rank holds (parallel.cp)."""
        return self.coords(rank)[3]


def degrees(cfg: Config, world_size: int) -> Degrees:
    """The degrees for this recipe at this world size. dp_shard=-1 takes the ranks the
    others leave; a recipe that does not shard replicates over them instead. Degrees a
    recipe does not use count as 1 (validate refuses them before a launch)."""
    p = cfg.parallel
    can = engines.spec(cfg.recipe.engine).parallelism
    tp, pp, cp = (p.tp if can.tp else 1), (p.pp if can.pp else 1), (p.cp if can.cp else 1)
    ep = p.ep if can.ep else 1
    rest = p.dp_shard if p.dp_shard != -1 else max(1, world_size // max(1, p.dp_replicate * tp * pp * cp))
    if can.shards:
        return Degrees(pp=pp, dp_replicate=p.dp_replicate, dp_shard=rest, tp=tp, cp=cp, ep=ep)
    return Degrees(pp=pp, dp_replicate=p.dp_replicate * rest, dp_shard=1, tp=tp, cp=cp, ep=ep)


def data_parallel_size(cfg: Config, world_size: int) -> int:
    """Ranks that see different data: world / (tp x pp x cp)."""
    return degrees(cfg, world_size).dp


def grad_accum(cfg: Config, world_size: int) -> int:
    t = cfg.train
    if t.global_batch is None:
        return t.grad_accum
    return t.global_batch // (t.micro_batch * data_parallel_size(cfg, world_size))


def global_batch(cfg: Config, world_size: int) -> int:
    return cfg.train.micro_batch * grad_accum(cfg, world_size) * data_parallel_size(cfg, world_size)


def back_off(cfg: Config, micro_batch: int, grad_accum: int) -> tuple[int, int] | None:
    """Take `backed_off` into cfg.train (grad_accum only when it is not derived from
    train.global_batch); the new (micro-batch, accumulation), or None at 1. Both the rank
    (in place) and the launcher (before a relaunch) record a back-off through it."""
    smaller = backed_off(micro_batch, grad_accum)
    if smaller is not None:
        cfg.train.micro_batch = smaller[0]
        if cfg.train.global_batch is None:
            cfg.train.grad_accum = smaller[1]
    return smaller


def backed_off(micro_batch: int, grad_accum: int) -> tuple[int, int] | None:
    """train.oom_backoff: the largest micro-batch below `micro_batch` that divides it, and
    the accumulation that keeps micro x accum (the global batch) the same; None at 1.
    8 x 1 -> 4 x 2, 6 x 1 -> 3 x 2, 3 x 2 -> 1 x 6."""
    for smaller in range(micro_batch // 2, 0, -1):
        if micro_batch % smaller == 0:
            return smaller, grad_accum * (micro_batch // smaller)
    return None

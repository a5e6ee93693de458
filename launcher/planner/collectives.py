"""The data-parallel collectives of one optimizer step on one rank, counted and sized by the
engines' own rules (issue 49 item 4; docs/memory.md, "The gathered working set"): `make plan
--json` shows them per row ("collectives"), beside the step time cost.py estimates.

    ddp     one all-reduce of the fp32 gradients a step (no_sync on the other micro-batches:
            engines/ddp/engine.py), in buckets of recipe.ddp.bucket_cap_mb.
    zero1/2 an all-reduce of the gradients per reduce_bucket_size bucket (stage 2 every
            micro-batch, stage 1 at the step): DeepSpeed 0.19 reduces a bucket with one
            all-reduce (stage_1_and_2.py average_tensor -> allreduce_and_scatter, under
            use_multi_rank_bucket_allreduce, on by default), twice a reduce-scatter's traffic;
            with it off (recipe.zero.extra), one reduce per destination rank's slice. Then one
            all_gather_into_tensor of the updated weights per parameter group (runtime/utils.py
            all_gather_dp_groups): allgather_bucket_size splits only the path torch without
            all_gather_into_tensor would take, so it moves nothing here.
    zero3   all-gathers module by module as gathered.replay launches them (a fetch and a
            prefetch each one all_gather_coalesced), forward and again in backward for what
            the reuse window released, every micro-batch; reduce-scatters in
            reduce_bucket_size buckets, every micro-batch.
    fsdp    an all-gather per unit in forward (the root and each block) and per block again
            in backward when recipe.fsdp.reshard_after_forward (not the root, never resharded),
            a reduce-scatter per unit (fp32: the recipe reduces in fp32), every micro-batch.
Bytes are what the rank sends or receives as the collective's whole tensor (the gathered
output, the reduce-scatter's input): a ring moves (g-1)/g of it over the link.
"""

from __future__ import annotations

import math

from launcher.config import Config
from launcher.parallel import ds_config
from launcher.planner import gathered as G
from launcher.planner import lora
from launcher.planner.footprint import Layout, ds_weight_bytes, param_share


def counted(count: float, nbytes: float) -> dict[str, int]:
    return {"count": int(count), "bytes": int(nbytes)}


def per_step(cfg: Config, layout: Layout) -> dict[str, dict[str, int]]:
    """{"all_gather" | "reduce_scatter" | "all_reduce": {"count", "bytes"}} per rank and step;
    {} where no data-parallel rank shares the parameters (dp x cp = 1) or for a pipeline."""
    if layout.dp * layout.cp == 1 or layout.pp > 1:
        return {}

    accum, P = cfg.train.grad_accum, param_share(cfg, layout)
    T = lora.counts(cfg.model).trainable if lora.enabled(cfg.model) else P
    w = ds_weight_bytes(cfg)
    if layout.fsdp:
        return fsdp(cfg, layout, P, T, accum)
    if layout.shard == "zero3":
        z = cfg.recipe.zero
        passes = G.gathers(
            cfg.model,
            z.max_live_parameters,
            ds_config.prefetch_bucket(cfg),
            z.max_reuse_distance,
            ds_config.persistence_threshold(cfg),
        )
        n, elements = passes[True][0] + passes[False][0], passes[True][1] + passes[False][1]
        rs = math.ceil(T / ds_config.reduce_bucket(cfg))
        return {
            "all_gather": counted(accum * n, accum * w * elements),
            "reduce_scatter": counted(accum * rs, accum * w * T),
        }
    if layout.shard in ("zero1", "zero2"):
        times = accum if layout.shard == "zero2" else 1
        buckets = math.ceil(T / ds_config.reduce_bucket(cfg))
        groups = 1 if lora.enabled(cfg.model) else 2  # rank.engine.param_groups: matrices, vectors
        if ds_config.multi_rank_bucket_allreduce(cfg):
            reduced = {"all_reduce": counted(times * buckets, times * w * T)}
        else:  # a reduce per slice: a bucket's slices end where a rank's partition does
            reduced = {"reduce_scatter": counted(times * (buckets + layout.dp - 1), times * w * T)}
        return {**reduced, "all_gather": counted(groups, w * T)}
    return {"all_reduce": counted(math.ceil(4 * T / (cfg.recipe.ddp.bucket_cap_mb * 2**20)), 4 * T)}


def fsdp(cfg: Config, layout: Layout, P: int, T: int, accum: int) -> dict[str, dict[str, int]]:
    """FSDP2: the root and each block a unit, weights gathered in bf16 (fp32 in an fp32 run),
    gradients reduce-scattered in fp32."""
    m = cfg.model
    units = m.n_layers + 1
    again = m.n_layers if cfg.recipe.fsdp.reshard_after_forward else 0
    block = (P - m.vocab_size * m.dim * (1 if m.tie_embeddings else 2)) / m.n_layers  # a block's share of P
    w = ds_weight_bytes(cfg)
    return {
        "all_gather": counted(accum * (units + again), accum * w * (P + again * block)),
        "reduce_scatter": counted(accum * units, accum * 4 * T),
    }

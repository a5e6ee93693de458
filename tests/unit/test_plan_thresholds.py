"""Each DeepSpeed threshold a user sets in recipe.zero.* or recipe.zero.extra moves the plan
as it moves the engine: the value lands in ds_config.json (what DeepSpeed reads) and the
planner's term that DeepSpeed sizes by it moves by exactly its bytes (launcher/planner/zero.py
cites the allocating lines; docs/memory.md, "DeepSpeed's terms, line by line")."""

from __future__ import annotations

import pytest

from launcher.config import ACMode
from launcher.launch import cli
from launcher.parallel import ds_config
from launcher.planner import plan as planner

GPUS = 8


def row(recipe: str, *overrides: str):
    cfg = cli.compose_config(["model=llama3_8b", "precision=bf16", f"recipe={recipe}", *overrides])[0]
    zero = ds_config.deepspeed_config(cfg, GPUS, cuda=True)["zero_optimization"]
    return planner.memory_row(cfg, planner.layout_for(cfg, GPUS), ACMode.full, 1), zero, cfg


@pytest.mark.parametrize("recipe", ["zero1", "zero2", "zero3"])
def test_reduce_bucket_size(recipe):
    """reduce_bucket_size, 2 bytes an element: stage 3's bucket is held through the step
    (stage3.py _setup_for_real_optimizer); stage 1's whole gradients are reduced through one
    bucket after backward without overlap_comm (its peak); stage 2's buckets live only
    through backward (setup_buckets to _release_ipg_buffers) and move nothing the plan holds
    at the step: measured on real ranks, the step's states are the same at any size."""
    base, z0, cfg = row(recipe)
    big, z1, _ = row(recipe, "recipe.zero.reduce_bucket_size=500000000")
    assert (z0["reduce_bucket_size"], z1["reduce_bucket_size"]) == (cfg.model.dim**2, 500_000_000)
    delta = 2 * (500_000_000 - cfg.model.dim**2)
    moved = {
        "zero1": (big.grads_peak - base.grads_peak, big.grads - base.grads),
        "zero2": (0, big.grads - base.grads),
        "zero3": (big.grads - base.grads, 0),
    }[recipe]
    assert moved == ({"zero1": delta, "zero2": 0, "zero3": delta}[recipe], 0)


def test_overlap_comm_takes_stage_1s_peak_of_whole_gradients():
    off, z0, cfg = row("zero1")
    on, z1, _ = row("zero1", "recipe.zero.overlap_comm=true")
    assert (z0["overlap_comm"], z1["overlap_comm"]) == (False, True)
    assert off.grads_peak > on.grads_peak and off.grads == on.grads


def test_param_persistence_threshold():
    """stage3_param_persistence_threshold: parameters at or below it stay whole on every rank
    (parameter_offload.py mark_persistent_parameters): a threshold above a block's matrices
    keeps them all whole."""
    base, z0, cfg = row("zero3")
    whole, z1, _ = row("zero3", "recipe.zero.param_persistence_threshold=100000000")
    assert (z0["stage3_param_persistence_threshold"], z1["stage3_param_persistence_threshold"]) == (
        10 * cfg.model.dim,
        100_000_000,
    )
    assert whole.params - base.params > 2 * 32 * cfg.model.dim**2  # every block's attention matrices at least


def test_prefetch_bucket_and_max_live_parameters():
    """stage3_prefetch_bucket_size and stage3_max_live_parameters: what DeepSpeed gathers
    beside the module that computes (partitioned_param_coordinator.py fetch_sub_module,
    replayed by launcher/planner/gathered.py and checked against DeepSpeed's own count in
    tests/unit/test_gathered.py): the plan's temporaries move by 2 bytes an element of the
    working set's peak. Llama 3 8B's head (525M) leaves the 1e9 cap room for a block: a
    prefetch of 1 element still takes one whole parameter a hook, and a cap of 1.25 blocks
    keeps less gathered than the default's 1e9."""
    from launcher.config import block_matmul_params
    from launcher.planner import gathered as G

    base, z0, cfg = row("zero3")
    block = block_matmul_params(cfg.model)
    none, z1, c1 = row("zero3", "recipe.zero.prefetch_bucket_size=1")
    capped, z2, c2 = row("zero3", f"recipe.zero.max_live_parameters={block + block // 4}")
    assert z0["stage3_prefetch_bucket_size"] == block and z1["stage3_prefetch_bucket_size"] == 1
    assert z2["stage3_max_live_parameters"] == block + block // 4
    peaks = [G.of_config(c).peak for c in (cfg, c1, c2)]
    assert peaks[0] > peaks[1] and peaks[0] > peaks[2]
    assert (base.temp - none.temp, base.temp - capped.temp) == (2 * (peaks[0] - peaks[1]), 2 * (peaks[0] - peaks[2]))

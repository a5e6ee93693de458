"""`fsdp`: FSDP2 (`fully_shard`) on every transformer block and the root, over the
data-parallel ranks (HSDP when parallel.dp_replicate > 1). parallel.ep > 1 splits an MoE's
experts over ep of those ranks and shards them over the rest (launcher/parallel/experts.py).

Model states per rank (mixed-precision Adam): fp32 parameter shards 4Ψ/N, fp32 gradient
shards 4Ψ/N, Adam moments 8Ψ/N: 16Ψ/N. Each block's parameters are all-gathered (in
bf16 under precision=bf16) for its forward and again for its backward; gradients are
reduce-scattered in fp32.

The engine here (`ShardedEngine`) also runs `tp` and `tp_fsdp`: the three differ only in
what `launcher.parallel.mesh.parallelize` applies for their degrees, so they share the step,
the DCP checkpoints and the memory accounting.
"""

from engines import EngineSpec, Holding, Parallelism


def fsdp_holds(recipe) -> Holding:
    """The planner's formula: parameters, gradients and Adam states sharded over the
    data-parallel ranks (16Ψ/N); recipe.fsdp.cpu_offload keeps them on the host. Its
    engine frees the gradients after each step (Holding.grads_freed)."""
    return Holding(
        shard="zero3",
        fsdp=True,
        offload_optim=recipe.fsdp.cpu_offload,
        offload_params=recipe.fsdp.cpu_offload,
        grads_freed=True,
    )


SPEC = EngineSpec(
    Parallelism(shards=True, cp=True, ep=True),
    engine="engines.fsdp.engine",
    builds_on_meta=True,
    writes="dcp",
    reads=("ddp", "dcp"),
    fp8=True,
    holds=fsdp_holds,
)

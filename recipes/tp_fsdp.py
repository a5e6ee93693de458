"""`tp_fsdp`: 2-D parallelism. Tensor parallel inside groups of parallel.tp neighbouring
ranks, FSDP across the groups: FSDP shards the DTensors tensor parallel made along the
data-parallel mesh dimension. Model states per rank: 16 x (Ψ_matmul/(tp x dp) +
Ψ_replicated/dp). The engine is fsdp's ShardedEngine; launcher.parallel.parallelize
applies tensor parallel, then FSDP.
"""

from recipes.fsdp import build, consolidate  # noqa: F401  (the registry's interface)

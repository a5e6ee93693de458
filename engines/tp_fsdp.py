"""`tp_fsdp`: 2-D parallelism. Tensor parallel inside groups of parallel.tp neighbouring
ranks, FSDP across the groups: FSDP shards the DTensors tensor parallel made along the
data-parallel mesh dimension. Model states per rank: 16 x (Ψ_matmul/(tp x dp) +
Ψ_replicated/dp). The engine is fsdp's ShardedEngine; launcher.parallel.mesh.parallelize
applies tensor parallel, then FSDP.
"""

from engines import EngineSpec, Parallelism
from engines.fsdp import fsdp_holds

SPEC = EngineSpec(
    Parallelism(shards=True, tp=True, cp=True, required=("tp",)),
    engine="engines.fsdp.engine",
    builds_on_meta=True,
    writes="dcp",
    reads=("ddp", "dcp"),
    holds=fsdp_holds,
)

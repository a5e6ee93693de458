"""`tp`: tensor parallel (DTensor) over parallel.tp ranks; the ranks left over are
data-parallel replicas that average gradients after backward.

Model states per rank: the matmul weights (q/k/v/o, the SwiGLU projections; an untied
embedding and head by vocabulary) and their gradients and Adam states are split tp
ways; the norms (and a tied embedding) are replicated: 16 x (Ψ_matmul/tp + Ψ_replicated).
Each block all-reduces its activations twice in forward and twice in backward. The plan
is in launcher/parallel/cuts.py; the engine is fsdp's ShardedEngine (no FSDP here).
"""

from engines import EngineSpec, Holding, Parallelism

SPEC = EngineSpec(
    Parallelism(tp=True, required=("tp",)),
    engine="engines.fsdp.engine",
    builds_on_meta=True,
    writes="dcp",
    reads=("ddp", "dcp"),
    holds=lambda recipe: Holding(grads_freed=True),
)  # fsdp's engine frees them

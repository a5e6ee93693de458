"""`ddp`: DistributedDataParallel. Every rank holds the whole model, gradients and
optimizer state; gradients are all-reduced in buckets that overlap with backward.

Model states per rank (mixed-precision Adam under autocast): fp32 parameters 4Ψ, fp32
gradients 4Ψ, Adam moments 8Ψ: 16Ψ bytes, the same on every rank.
"""

from engines import EngineSpec, Holding, Parallelism

SPEC = EngineSpec(
    Parallelism(cp=True, ep=True),
    engine="engines.ddp.engine",
    reads=("ddp", "dcp"),
    fp16=True,
    fp8=True,
    holds=lambda recipe: Holding(grad_buckets=True),
)
"""Replicated: the whole model, its gradients and optimizer states on every rank."""

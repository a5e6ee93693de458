"""`pp_fsdp`: pipeline stages (engines/pp/), each sharded with FSDP2 over the
data-parallel ranks of its stage, and tensor parallel inside them where parallel.tp > 1:
the 3-D layout of the largest models (pp x fsdp, pp x tp x fsdp). The engine is pp's
PipelineEngine; each stage's modules get tensor parallel, then `fully_shard` per block
and on the stage as its root, the module the schedule runs.

Model states per rank: 16 x the stage's parameters (matrices / tp) / dp. During a step the
schedule keeps each stage's parameters gathered and its gradients unsharded from the first
micro-batch's backward to the last (torch.distributed.pipelining defers FSDP's
reduce-scatter to once per step), so a rank also holds its stage's parameters in the
compute dtype and their gradients in fp32 unsharded until the step's reduce-scatter: the
planner's pipeline-FSDP term (launcher/planner/footprint.py).
"""

import dataclasses

from engines import EngineSpec, Parallelism
from engines.fsdp import fsdp_holds

SPEC = EngineSpec(
    Parallelism(shards=True, tp=True, pp=True, required=("pp",)),
    engine="engines.pp.engine",
    builds_on_meta=True,
    writes="dcp",
    reads=("ddp", "dcp"),
    holds=lambda recipe: dataclasses.replace(fsdp_holds(recipe), grads_freed=False),
)  # kept over micro-batches

"""`pp`: pipeline parallel with torch.distributed.pipelining. The layers are cut into
stages at block boundaries (launcher/parallel/cuts.py: balanced by parameter count, or
parallel.pp_split); each rank holds its stage (interleaved_1f1b: pp_virtual_stages of
them, rank r holding stages r, r+pp, ...). Every rank cuts the model while it is still on
the meta device, then allocates and fills only its layers; the values are those every
other recipe draws for the same names (launcher/models/init.py), so each stage starts
from exactly the weights ddp starts from.

With parallel.tp > 1 each stage is tensor parallel too (pp x tp, the layout of a 70B
model over nodes: launcher/parallel/cuts.py's plan applied to each stage's modules); the
recipe `pp_fsdp` (engines/pp_fsdp.py) shards each stage over the data-parallel ranks with
FSDP2 (pp x fsdp, pp x tp x fsdp).

The data-parallel rank's batch (micro_batch x grad_accum sequences) goes through the
schedule as parallel.pp_microbatches micro-batches; the schedule scales gradients by
1/micro-batches, so the step equals one over the whole batch. Ranks left over
(world / pp) are data-parallel replicas that average gradients after the schedule.

A tied embedding and head live on the first and the last stage: two copies that start
equal, get the sum of both gradients (one all-reduce between those two ranks) and the
same Adam update, so they stay equal (one group for each data-parallel and
tensor-parallel position: the two copies are sharded alike). Model states per rank: 16
bytes x the stage's parameters (the first stage adds the embedding, the last the norm and
head), its matrices divided by tp.
"""

from engines import EngineSpec, Parallelism

SPEC = EngineSpec(
    Parallelism(tp=True, pp=True, required=("pp",)),
    engine="engines.pp.engine",
    builds_on_meta=True,
    writes="dcp",
    reads=("ddp", "dcp"),
)
"""Each pipeline rank holds its stages' layers (the planner's param_share by stage), split
tp ways where parallel.tp > 1."""

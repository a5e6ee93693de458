"""How a model is split over ranks: the degrees (pure arithmetic, read by both sides), the
device mesh and fully_shard, the tensor-parallel plan and pipeline stages, DCP checkpoints,
and DeepSpeed's JSON config. The recipes (engines/) are built from these parts."""

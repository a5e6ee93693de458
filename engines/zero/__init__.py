"""`zero1`, `zero2`, `zero3` and their offload variants: DeepSpeed ZeRO.

One engine for every stage; RUN_DIR/ds_config.json (written by the launch side from the
Hydra config, launcher/parallel/ds_config.py) says which. DeepSpeed owns the micro-batch loop's
gradient reduction, the sharded optimizer step and the checkpoint files; this module adds
what the launcher needs around it:

- the project's optimizer groups (decay on matrices only) and learning-rate schedule
  (launcher.config.lr_factor, handed to DeepSpeed as a client scheduler, so the curve is
  the one ddp follows);
- `state_bytes()`: the model-state tensors this rank really holds, counted from DeepSpeed's
  own buffers at the moment of the step where most of them are alive;
- checkpoints under the Checkpointer's folder, loaded with weights_only=True, and resumed
  at another world size through DeepSpeed's universal checkpoint;
- `consolidate()`: full fp32 weights from the shards on one process, for `make export`.
"""

from engines import EngineSpec, Holding
from launcher.host import deepspeed_env


def import_deepspeed():
    """DeepSpeed, told its accelerator first (it reads DS_ACCELERATOR when imported, and
    would probe and warn on a CPU machine), with torch.distributed.tensor, which it imports
    while it builds an engine. A rank imports both before it takes its memory baseline
    (SPEC.preload): about 100 MB that are the process's, not the model's."""
    deepspeed_env()
    import deepspeed  # local: order (deepspeed_env() first: DeepSpeed reads DS_ACCELERATOR when imported)
    import torch.distributed.tensor  # noqa: F401  # local: torch (launch side)

    return deepspeed


def holds(recipe) -> Holding:
    """The planner's formula: stage k shards the first k of optimizer states, gradients and
    parameters over the data-parallel ranks; offload moves them to the host. Without
    offload, DeepSpeed frees the step's gradients after the update (zero_grad(set_to_none=True))
    and keeps only the buffers launcher.planner.footprint.grads_kept counts."""
    z = recipe.zero
    offload = z.offload_optimizer.value != "none"
    return Holding(
        shard=f"zero{z.stage}" if z.stage else "none",
        offload_optim=offload,
        offload_params=z.offload_param.value != "none",
        grads_freed=z.stage > 0 and not offload,
    )


SPEC = EngineSpec(
    engine="engines.zero.engine",
    writes="deepspeed",
    reads=("deepspeed",),
    holds=holds,
    fp16=True,
    deepspeed=True,
    preload=import_deepspeed,
)

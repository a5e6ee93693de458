"""Expert parallel (parallel.ep > 1): an MoE's routed experts split over ep of the
data-parallel ranks, E/ep each; the tokens go to them and back by all-to-all
(launcher/models/experts.py). The rest of the model is held as the recipe holds it.

The ranks that share samples for data parallel (fsdp: dp_shard x cp flattened; ddp: the
world) are cut into groups of ep neighbours: ep rank r of a group holds experts
[r E/ep, (r+1) E/ep), and the ranks at the same position in every group hold the same
experts (torchtitan's "efsdp": world / ep of them). So

    fsdp: experts Shard(0) DTensors over the ep ranks, FSDP-sharded again over the efsdp
          ranks (a 2-D DTensor as tensor parallel + FSDP makes; DCP reshards it to any ep),
          on dimension 1 where those ranks outnumber the E/ep experts (expert_placement);
    ddp:  experts plain local tensors, left out of DDP and averaged over the efsdp ranks
          after backward (reduce_expert_grads).

Gradient scaling: an expert's gradient on its rank already sums the tokens of all ep ranks
of its group (the all-to-all's backward brings them), so the average over efsdp ranks
is divided by the whole data-parallel size (efsdp x ep), not efsdp alone: each token's
expert gradient equals ep=1's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from launcher.models.experts import Experts

WEIGHTS = ("w1", "w2", "w3")


def experts_of(model: nn.Module) -> list[tuple[str, Experts]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Experts)]


def expert_param_names(model: nn.Module) -> list[str]:
    return [f"{name}.{w}" if name else w for name, _ in experts_of(model) for w in WEIGHTS]


def split_mesh(flat_mesh, ep: int):
    """The data-parallel ranks (a 1-D mesh) as a 2-D mesh (efsdp, ep): ep neighbours hold
    the E experts between them, the efsdp ranks at one ep position hold the same ones."""
    return flat_mesh._unflatten(0, (flat_mesh.size() // ep, ep), ("efsdp", "ep"))


def shard_as_dtensors(model: nn.Module, ep_mesh) -> None:
    """Each Experts' weights as Shard(0) DTensors over `ep_mesh` (meta or real: no copy of
    another rank's experts is made), and the module told its ep group."""
    from torch.distributed.tensor import DTensor, Shard  # local: start-up (torch.distributed.tensor, 2.8 s)

    ep, r = ep_mesh.size(), ep_mesh.get_local_rank()
    for _, m in experts_of(model):
        for w in WEIGHTS:
            p = getattr(m, w)
            n = p.size(0) // ep
            local = p.detach()[r * n : (r + 1) * n]
            setattr(
                m,
                w,
                nn.Parameter(
                    DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride()),
                    p.requires_grad,
                ),
            )
        m.ep_group = ep_mesh.get_group()


def shard_locally(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Each Experts' weights cut to this rank's E/ep experts as plain tensors (still on
    meta: the engine materializes them), with their box in the full tensor for the init."""
    ep, r = dist.get_world_size(group), dist.get_rank(group)
    for _, m in experts_of(model):
        for w in WEIGHTS:
            p = getattr(m, w)
            n = p.size(0) // ep
            box = ((r * n, (r + 1) * n), *((0, d) for d in p.shape[1:]))
            m.held_boxes[w] = (tuple(p.shape), box)
            setattr(m, w, nn.Parameter(p.detach()[r * n : (r + 1) * n].clone(), p.requires_grad))
        m.ep_group = group


def expert_fsdp(model: nn.Module, efsdp_mesh, divide: int, kwargs: dict, reshard: bool) -> None:
    """fully_shard each Experts over the efsdp ranks (before its block's fully_shard, which
    then leaves them to it), its reduce-scatter divided by the whole data-parallel size
    `divide` (see the module's note), on the dimension expert_placement picks. gloo has no
    pre-multiplied sum: it sums, then divides (not on one efsdp rank, where torch 2.13's
    FSDP would divide twice)."""
    from torch.distributed.fsdp import fully_shard  # local: start-up (torch.distributed.fsdp, 4.6 s)

    for _, m in experts_of(model):
        place = expert_placement(m, efsdp_mesh.size(), dist.get_world_size(m.ep_group))
        fully_shard(m, mesh=efsdp_mesh, reshard_after_forward=reshard, shard_placement_fn=place, **kwargs)
        m.set_gradient_divide_factor(float(divide))
        if dist.get_backend() == "gloo" and efsdp_mesh.size() > 1:
            m.set_force_sum_reduction_for_comms(True)


def expert_placement(module: nn.Module, ranks: int, ep: int = 1):
    """FSDP2's shard_placement_fn for the routed experts under `module` sharded over `ranks`:
    Shard(1) where the ranks outnumber the experts each ep rank holds (E/ep), else None
    (FSDP's own Shard(0)); None for a module without such experts. Dimension 0 cut in whole
    experts over more ranks than experts leaves a whole expert on the first ranks and none
    on the last (Mixtral's 8 over 16: twice the mean on rank 0, and FSDP pads every rank to
    it); dimension 1 (w1, w3: the expert width; w2: dim) splits every expert evenly, as
    torchtitan does (torchtitan/distributed/fsdp.py)."""
    from torch.distributed.tensor import Shard  # local: start-up (torch.distributed.tensor, 2.8 s)

    stacked = {id(getattr(m, w)) for _, m in experts_of(module) if m.num_experts // ep < ranks for w in WEIGHTS}
    if not stacked:
        return None
    return lambda p: Shard(1) if id(p) in stacked else None


def join_expert_files(folder, model: dict, states: dict | None = None) -> None:
    """A ddp checkpoint under parallel.ep (engines/ddp/engine.py: one experts file per ep
    rank): the experts joined in expert order into `model` (name -> whole tensor) and, given
    ddp's optimizer `states` (parameter index -> its state), their optimizer states too.
    Nothing without such files."""
    parts = [torch.load(f, map_location="cpu", weights_only=True) for f in sorted(folder.glob("experts-*-of-*.pt"))]
    if not parts:
        return
    for name in parts[0]["model"]:
        model[name] = torch.cat([p["model"][name] for p in parts])
    for pid, first in parts[0]["optim"].items() if states is not None else ():
        states[pid] = {k: torch.cat([p["optim"][pid][k] for p in parts]) if v.dim() else v for k, v in first.items()}


def own_rows(t: torch.Tensor, ep: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s E/ep experts of a whole (E, ...) tensor; a scalar (a step count) whole."""
    if not t.dim():
        return t
    n = t.size(0) // ep
    return t[rank * n : (rank + 1) * n].clone()

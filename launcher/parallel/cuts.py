"""How the decoder in gpt.py is cut: its tensor-parallel plan and its pipeline stages.

Kept next to the model because both name its modules. Parameter names never change:
a tensor-parallel shard, an FSDP shard and a pipeline stage all hold `layers.3.attention
.wq.weight` under the full model's name, so a distributed checkpoint written at one
layout loads at any other.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from launcher.config import ModelConfig, block_matmul_params
from launcher.models import Layout, model_layout


# ----------------------------------------------------------------------------- tensor parallel
class Replicated(ParallelStyle):
    """A module computed whole on every tensor-parallel rank: its parameters become
    Replicate DTensors (so every parameter of the model is a DTensor on the same mesh,
    which gradient clipping and FSDP rely on), its input is brought to `input_layout`
    and replicated, its output is handed on as `output_layout`, as a local tensor.
    (torch has no such style: ColwiseParallel/RowwiseParallel shard, SequenceParallel
    shards activations.)"""

    def __init__(self, input_layout: Placement = Replicate(), output_layout: Placement = Replicate()):
        super().__init__()
        self.input_layout, self.output_layout = input_layout, output_layout

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for p_name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(
                p_name, nn.Parameter(DTensor.from_local(param, mesh, [Replicate()], run_check=False))
            )

    def _input(self, module, inputs, mesh):
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [self.input_layout], run_check=False)
        return (x.redistribute(placements=[Replicate()]), *inputs[1:])

    def _output(self, module, output, mesh):
        return output.redistribute(placements=[self.output_layout]).to_local()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition, self._input, self._output)


def tp_plan(layout: Layout, sequence_parallel: bool) -> tuple[dict[str, ParallelStyle], dict[str, ParallelStyle]]:
    """(plan for the root modules, plan for each block), Megatron-style: q/k/v and the
    SwiGLU up/gate projections split by output columns, so each rank holds whole heads
    (the forward's view(b, t, -1, head_dim) finds its local head count) and a slice of the
    hidden size; the attention output and down projections split by input rows, their
    partial sums all-reduced. Norms are replicated (sequence_parallel: they run on a
    slice of the sequence and the all-reduce becomes reduce-scatter + all-gather).
    A tied embedding is replicated whole: the same tensor is the vocabulary-parallel
    embedding's rows and the column-parallel head's columns only when both are sharded
    identically, which the untied case does (vocab-parallel embedding, column head).
    Module names come from the model's `layout` (gpt.py's, or a Llama-family HF model's)."""
    stream = Shard(1) if sequence_parallel else Replicate()  # the residual stream between blocks
    norm: ParallelStyle = SequenceParallel() if sequence_parallel else Replicated()
    if layout.tied:
        root = {layout.embed: Replicated(output_layout=stream), layout.head: Replicated(input_layout=stream)}
    else:
        root = {
            layout.embed: RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
            layout.head: ColwiseParallel(input_layouts=stream, output_layouts=Replicate()),
        }
    root[layout.norm] = norm
    block: dict[str, ParallelStyle] = {name: norm for name in layout.norms}
    block.update({name: ColwiseParallel() for name in layout.colwise})
    block.update({name: RowwiseParallel(output_layouts=stream) for name in layout.rowwise})
    if sequence_parallel:  # gather the sequence before the matmuls that need all of it
        gather = PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None), use_local_output=True
        )
        block[layout.attention] = gather
        block[layout.mlp] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    return root, block


def apply_tp(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Shard `model` in place over the 1-D tensor-parallel mesh: the whole model, or a
    pipeline Stage (the root modules it holds: the embedding on the first stage, the norm
    and head on the last)."""
    layout = model_layout(model)
    root, block = tp_plan(layout, sequence_parallel)
    root = {name: style for name, style in root.items() if holds(model, name)}
    if root:
        parallelize_module(model, mesh, root)
    for layer in held_blocks(model, layout):
        parallelize_module(layer, mesh, block)
    if layout.tied and holds(model, layout.head) and holds(model, layout.embed):
        # each style made its own Parameter: tie them again
        model.get_submodule(layout.head).weight = model.get_submodule(layout.embed).weight


def holds(model: nn.Module, name: str) -> bool:
    """`model` has the module `name` and it is not a stand-in for one another stage holds."""
    try:
        return not isinstance(model.get_submodule(name), nn.Identity)
    except AttributeError:
        return False


def held_blocks(model: nn.Module, layout: Layout | None = None) -> list[nn.Module]:
    """The transformer blocks `model` holds: all of a whole model's (a ModuleList), a
    Stage's (a ModuleDict by layer index), without the stand-ins for other stages' layers."""
    container = model.get_submodule((layout or model_layout(model)).layers)
    found = container.values() if isinstance(container, nn.ModuleDict) else container
    return [b for b in found if not isinstance(b, nn.Identity)]


# ----------------------------------------------------------------------------- pipeline
def stage_bounds(cfg: ModelConfig, n_stages: int, split: list[int] | None = None) -> list[tuple[int, int]]:
    """[first, end) layers of each stage: `split` (the first layer of stages 2..n) or, by
    default, contiguous stages whose largest parameter count is smallest. The first stage
    also holds the embedding, the last the final norm and the head (a tied head is a copy
    there, so it counts too)."""
    n = cfg.n_layers
    if split is not None:
        starts = [0, *split]
        return list(zip(starts, [*split, n]))
    layer = block_matmul_params(cfg) + 2 * cfg.dim  # and its two norms
    first_extra = cfg.vocab_size * cfg.dim
    last_extra = cfg.dim + cfg.vocab_size * cfg.dim

    def cost(a: int, b: int) -> int:
        return (b - a) * layer + (first_extra if a == 0 else 0) + (last_extra if b == n else 0)

    # best[s][i]: the smallest possible largest stage when the first i layers form s stages.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for s in range(1, n_stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                worst = max(best[s - 1][j], cost(j, i))
                if worst < best[s][i]:
                    best[s][i], cut[s][i] = worst, j
    ends, i = [], n
    for s in range(n_stages, 0, -1):
        ends.append(i)
        i = cut[s][i]
    ends.reverse()
    return list(zip([0, *ends[:-1]], ends))


class Stage(nn.Module):
    """Some layers of a decoder, with the embedding if it holds layer 0 and the final norm
    and head if it holds the last layer. Modules are the full model's own (not copies),
    under the full model's names (`layout`), and the middle is the full model's own
    `run_blocks`."""

    def __init__(self, model: nn.Module, layers: Iterable[int]):
        super().__init__()
        layers = sorted(layers)
        layout = model_layout(model)
        blocks = model.get_submodule(layout.layers)
        last = layers[-1] == len(blocks) - 1
        self.__dict__["parts"] = {  # the same modules, for forward (registered below under their names)
            "embed": model.get_submodule(layout.embed) if layers[0] == 0 else None,
            "norm": model.get_submodule(layout.norm) if last else None,
            "head": model.get_submodule(layout.head) if last else None,
            "run": model.run_blocks,
        }
        self.__dict__["blocks"] = nn.ModuleDict({str(i): blocks[i] for i in layers})
        self.layout = layout  # model_layout(stage): the full model's names
        for name, part in ((layout.embed, "embed"), (layout.norm, "norm"), (layout.head, "head")):
            if self.parts[part] is not None:
                _place(self, name, self.parts[part])
        _place(self, layout.layers, self.blocks)

    def forward(self, h: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """`positions`: packed samples' (B, T), handed to every stage by the schedule as a
        keyword (engines/pp/engine.py), beside the hidden states it sends between stages."""
        if self.parts["embed"] is not None:
            h = self.parts["embed"](h)
        h = self.parts["run"](((int(i), layer) for i, layer in self.blocks.items()), h, positions)
        if self.parts["head"] is not None:
            h = self.parts["head"](self.parts["norm"](h))
        return h


def _place(root: nn.Module, name: str, module: nn.Module) -> None:
    """Register `module` at dotted `name` under `root`, making empty containers on the way."""
    *path, leaf = name.split(".")
    for part in path:
        if part not in root._modules:
            root.add_module(part, nn.Module())
        root = root._modules[part]
    root.add_module(leaf, module)

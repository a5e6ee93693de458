"""Distributed checkpoints (torch.distributed.checkpoint) for the recipes that split the
model: fsdp, tp, tp_fsdp, pp. Written under the engine folder the Checkpointer gives
(its atomic rename, manifest, `latest` and keep-K cover these files like any other).

    engine/.metadata, engine/__R_0.distcp   DCP: each rank writes its own shards of the
                                            model and the Adam states, keyed by the full
                                            model's parameter names
    engine/scheduler.pt                     the LR schedule (rank 0; weights_only load)

DCP records every tensor's global shape and where each shard lies, so a load at another
layout (other world size, FSDP <-> TP <-> pipeline stages, one process) reads the pieces
each rank now needs: that is the resharding. A ddp checkpoint (whole tensors in
model.pt/optim.pt) loads too, and ddp loads these. Only tensors go into DCP (DCP would load
other objects with pickle); DCP's own .metadata file is its pickle format, which torch's
FileSystemReader reads with plain pickle.load: every load here goes through SafeReader,
which admits only DCP's metadata classes and tensor entries. A tied head is stored once,
as `tok_embeddings.weight`, whichever rank holds it under which name.
"""

from __future__ import annotations

import copy
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from launcher import models
from launcher.config import Config
from launcher.parallel.experts import join_expert_files
from launcher.rank.engine import param_groups, set_lrs, trained_state

OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)  # keys "state.<fqn>.<exp_avg|...>"


def _canonical_key(key: str, tied: tuple[str, str] | None, prefix: str = "") -> str:
    if tied is None:
        return key
    head, embed = prefix + tied[0], prefix + tied[1]
    return embed + key[len(head) :] if key.startswith(head) else key


def _canonical(
    state: dict[str, torch.Tensor], tied: tuple[str, str] | None, prefix: str = ""
) -> dict[str, torch.Tensor]:
    """The same tensors, a tied head under the embedding's name (once). `tied`: the
    (head, embedding) weight names of a tied model (Layout.tied_names), or None."""
    out: dict = {}
    for key, value in state.items():
        out.setdefault(_canonical_key(key, tied, prefix), value)
    return out


def model_options(model: nn.Module) -> StateDictOptions | None:
    """With frozen parameters (model.lora's base) the state is what trains: the base is read
    from model.pretrained again."""
    if all(p.requires_grad for p in model.parameters()):
        return None
    return StateDictOptions(ignore_frozen_params=True, strict=False)


def _tensors(model: nn.Module, optimizer: torch.optim.Optimizer, tied: tuple[str, str] | None):
    """(model state, optimizer state, what goes into DCP): the first two are the live
    tensors (DCP loads in place into them), the third is their canonical, tensor-only view."""
    model_sd = get_model_state_dict(model, options=model_options(model))
    optim_sd = get_optimizer_state_dict(model, optimizer, options=OPTIM)  # initialises Adam's state if empty
    saved = {
        "model": _canonical(model_sd, tied),
        "optim": _canonical({k: v for k, v in optim_sd.items() if k.startswith("state.")}, tied, "state."),
    }
    return model_sd, optim_sd, saved


def save(path: Path, model: nn.Module, optimizer, scheduler, tied: tuple[str, str] | None, rank: int, staging=None):
    """Called on every rank. `tied`: Layout.tied_names() of the model. With `staging` (the
    Checkpointer of a checkpoint.async_save): DCP's async_save copies this rank's shards
    into host memory and writes them on a thread of its own, its collectives on the
    checkpointer's group; returns what finishes the save (the writer thread calls it)."""
    _, _, saved = _tensors(model, optimizer, tied)
    schedule = {"scheduler": copy.deepcopy(scheduler.state_dict())}
    if staging is None:
        dcp.save(saved, checkpoint_id=str(path))
        written = None
    else:
        written = dcp.async_save(
            saved, checkpoint_id=str(path), process_group=staging.group, async_stager=staging.stager()
        )

    def finish() -> None:
        if written is not None:
            written.result()
        if rank == 0:
            torch.save(schedule, path / "scheduler.pt")

    if staging is None:
        finish()
        return None
    return finish


def warm(model: nn.Module, optimizer, tied: tuple[str, str] | None, staging):
    """checkpoint.async_save: what async_save stages, staged once at start-up into the same
    stager (whose buffers every save then reuses: the first save's stall is the steady one)."""
    return staging.stager().stage(_tensors(model, optimizer, tied)[2])


def load(path: Path, model: nn.Module, optimizer, scheduler, cfg: Config) -> None:
    """Called on every rank; `path` holds a DCP checkpoint of any layout, or ddp's files."""
    tied = models.layout(cfg).tied_names()
    model_sd, optim_sd, wanted = _tensors(model, optimizer, tied)
    if (path / DDP_MODEL).is_file():
        _load_ddp_files(path, cfg, wanted)
        schedule = torch.load(path / DDP_OPTIM, map_location="cpu", weights_only=True)["scheduler"]
    else:
        dcp.load(wanted, storage_reader=SafeReader(path))
        schedule = torch.load(path / "scheduler.pt", map_location="cpu", weights_only=True)["scheduler"]
    set_model_state_dict(model, model_sd, options=model_options(model))
    set_optimizer_state_dict(model, optimizer, optim_sd, options=OPTIM)
    scheduler.load_state_dict(schedule)
    # The LR lives in the optimizer's param groups, which DCP does not hold: the schedule sets it.
    set_lrs(scheduler)


DDP_MODEL, DDP_OPTIM = "model.pt", "optim.pt"  # engines/ddp/engine.py's files


def _load_ddp_files(path: Path, cfg: Config, wanted: dict[str, dict[str, torch.Tensor]]) -> None:
    """What DCP's load does, from ddp's whole tensors: each rank copies its part into its
    tensors (a DTensor takes its shard; no communication). ddp's optimizer numbers its
    parameters in build_optimizer's order, which a model on the meta device gives."""
    whole = torch.load(path / DDP_MODEL, map_location="cpu", weights_only=True)
    shape = models.on_meta(cfg)
    name_of = {id(p): n for n, p in shape.named_parameters()}
    names = [name_of[id(p)] for g in param_groups(shape, cfg.optim.weight_decay) for p in g["params"]]
    states = torch.load(path / DDP_OPTIM, map_location="cpu", weights_only=True)["optimizer"]["state"]
    join_expert_files(path, whole, states)  # parallel.ep: the experts' files (at any ep here)
    whole.update({f"state.{names[pid]}.{k}": v for pid, state in states.items() for k, v in state.items()})
    for part in wanted.values():
        for key, t in part.items():
            src = whole[key]
            if isinstance(t, DTensor):
                src = distribute_tensor(src.to(t.device), t.device_mesh, t.placements, src_data_rank=None)
            t.copy_(src)


def consolidate(cfg: Config, engine_dir: Path) -> dict[str, torch.Tensor]:
    """Full fp32 weights on one process, no process group (export): DCP reads every
    shard into the full model's tensors."""
    layout = models.layout(cfg)
    model = models.on_meta(cfg).to_empty(device="cpu")  # storage without the cost of initialising it
    if layout.tied:  # to_empty gave each module its own tensor: tie them again
        model.get_submodule(layout.head).weight = model.get_submodule(layout.embed).weight
    state = trained_state(model)  # model.lora: the adapters alone
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": no_dist=True says so
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": _canonical(state, layout.tied_names())}, storage_reader=SafeReader(engine_dir), no_dist=True)
    return {k: v.float() for k, v in state.items()}


# ----------------------------------------------------------------------------- reading safely
class CheckpointRefused(ValueError):
    """A checkpoint file that reading could make run code, or that points outside its folder."""


# What DCP (torch 2.13) pickles into .metadata; nothing else may be constructed.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "StorageMeta",
        "MetadataIndex",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if name in _METADATA_GLOBALS.get(module, ()) or dtype:
            return super().find_class(module, name)
        raise CheckpointRefused(f"{module}.{name}")


def read_metadata(folder: Path) -> Metadata:
    """`folder`/.metadata parsed without running code: only DCP's metadata classes may
    appear, every entry must be a tensor (DCP unpickles a bytes entry with
    weights_only=False), and every data file must lie in the folder itself."""
    path = Path(folder) / ".metadata"
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except CheckpointRefused as e:
        raise CheckpointRefused(
            f"{path} would construct {e}, which DCP metadata never contains: refusing to load "
            f"it (a checkpoint must never run code)"
        ) from None
    except Exception as e:  # truncated or not a pickle at all
        raise CheckpointRefused(f"{path} is not readable DCP metadata ({e.__class__.__name__}: {e})") from None
    if (
        not isinstance(metadata, Metadata)
        or not isinstance(metadata.state_dict_metadata, dict)
        or not isinstance(metadata.storage_data or {}, dict)
    ):
        raise CheckpointRefused(f"{path} holds a {type(metadata).__name__} that is not DCP metadata")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointRefused(
                f"{path}: entry {key!r} is not a tensor ({type(entry).__name__}); DCP would "
                f"unpickle it with weights_only=False: refusing to load it"
            )
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if (
            not isinstance(info, _StorageInfo)
            or not isinstance(name, str)
            or Path(name).name != name
            or name in ("", ".", "..")
        ):
            raise CheckpointRefused(f"{path} points at data outside its folder ({name!r}): refusing to load it")
    return metadata


class SafeReader(FileSystemReader):
    """torch's FileSystemReader, with the metadata read by read_metadata (tensor data are
    read by torch.load(weights_only=True) already)."""

    def __init__(self, folder: Path):
        super().__init__(str(folder))
        self.folder = Path(folder)

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = read_metadata(self.folder)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

"""train.activation_offload: what the blocks save for backward moves to host memory during
forward and comes back for backward (torch.autograd.graph.saved_tensors_hooks around the
blocks, launcher/models/gpt.py::run_layers).

torch's `save_on_cpu` is the floor: it copies on the compute stream, so every copy out
stalls forward and every copy back stalls backward. Here, on CUDA:
- out: the copy into pinned host memory runs on a side stream once the compute stream has
  made the tensor (an event), and the tensor's memory is returned to the allocator only
  when that copy is done (record_stream): forward does not wait;
- back: unpacking a tensor starts the copies of the next `PREFETCH` tensors backward will
  ask for (saved in reverse order, as backward walks the graph) on the side stream, so a
  block's activations arrive while the block after it computes its gradients.
Pinned memory that cannot be had (a container's locked-memory limit) falls back to
pageable memory with one line: slower copies, the same result.

On CPU (the tests) the tensors are copied into separate host tensors, synchronously: the
same hooks, the same bytes counted (`offloaded_bytes`), no memory saved (host is device).

Not moved: parameters and views of them (model state; FSDP's and ZeRO-3's gathered
weights are Parameters too), tensors below `MIN_BYTES` (bookkeeping, not worth a copy),
and tensor subclasses (DTensor: tensor parallel is refused at launch)."""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
import torch.nn as nn

MIN_BYTES = 64 * 1024
PREFETCH = 4


class Stored:
    """One storage moved to the host, as autograd holds it: the packed value of every saved
    tensor that views it. It lives exactly as long as the graph needs it (autograd drops it
    after the last node that saved it has run, or when the graph is dropped without a
    backward: an out-of-memory error), and with it the host copy and the device copy
    brought back."""

    __slots__ = ("host", "done", "device", "arrived", "__weakref__")

    def __init__(self, host: torch.Tensor, done):
        self.host, self.done = host, done
        self.device: torch.Tensor | None = None
        self.arrived: Any = None  # a torch.cuda.Event


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """One per model; entered around the blocks of each forward. `offloaded_bytes`: what
    the last forward moved (the planner's host activation bytes); `kept_bytes`: what it
    saw and left on the device (small tensors). A tensor saved by several ops (a norm's
    output, the input of three projections) is moved once."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        # Two side streams: copies out in forward never queue behind copies back (a pipeline
        # runs one micro-batch's forward while another's backward prefetches).
        self.out_stream = torch.cuda.Stream(device) if self.cuda else None
        self.in_stream = torch.cuda.Stream(device) if self.cuda else None
        self.pinned = self.cuda and _can_pin()
        self.order: list[weakref.ref] = []  # the Stored of the graphs alive, in pack order
        self.seen: dict[int, tuple] = {}  # id(base tensor) -> (weakref Stored, weakref base, base's version)
        self.offloaded_bytes = self.kept_bytes = 0
        self.model: nn.Module | None = None
        self.persistent: set[int] = set()
        super().__init__(self._pack, self._unpack)

    def watch(self, model: nn.Module) -> "ActivationOffload":
        """The model whose parameters and buffers are never moved (nor views of them: the
        rotary table's slices)."""
        self.model = model
        return self

    def __enter__(self):
        self.order = [ref for ref in self.order if ref() is not None]
        if not self.order:  # no graph of an earlier forward alive: a new step, counted afresh
            self.offloaded_bytes = self.kept_bytes = 0
        self.persistent = {
            t.untyped_storage().data_ptr()
            for t in (*self.model.parameters(), *self.model.buffers())
            if type(t) in (torch.Tensor, nn.Parameter)
        }
        return super().__enter__()

    def __exit__(self, *exc):
        self.seen.clear()
        return super().__exit__(*exc)

    # ------------------------------------------------------------------ forward: out
    def _pack(self, t: torch.Tensor):
        if type(t) is not torch.Tensor or t.device.type != self.device.type:  # a Parameter, a DTensor
            return t
        if isinstance(t._base, nn.Parameter) or t.untyped_storage().data_ptr() in self.persistent:
            return t  # model state, not an activation
        storage = t.untyped_storage()
        if storage.nbytes() < MIN_BYTES:
            self.kept_bytes += t.numel() * t.element_size()
            return t.detach()  # not `t`: a node's own saved output would hold the node in a cycle
        view = (t.dtype, t.storage_offset(), tuple(t.size()), tuple(t.stride()))
        # Views of one tensor (q, k, v cut from one output; a tensor saved by three ops)
        # share its storage: it moves once (unless written to in between), each view is
        # rebuilt on it in backward.
        base = t if t._base is None else t._base
        again = self.seen.get(id(base))
        if again is not None and again[1]() is base and again[2] == base._version and again[0]() is not None:
            return again[0](), view
        flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
        host, done = self._host(flat.numel()), None
        if self.cuda:
            self.out_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.out_stream):
                host.copy_(flat, non_blocking=host.is_pinned())
                done = torch.cuda.Event()
                done.record(self.out_stream)
            flat.record_stream(self.out_stream)  # the storage is reused only after the copy
        else:
            host.copy_(flat)
        stored = Stored(host, done)
        self.order.append(weakref.ref(stored))
        self.seen[id(base)] = (weakref.ref(stored), weakref.ref(base), base._version)
        self.offloaded_bytes += flat.numel()
        return stored, view

    def _host(self, nbytes: int) -> torch.Tensor:
        if self.pinned:
            try:
                return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as e:  # the locked-memory limit reached mid-run: pageable from here on
                self.pinned = False
                _pageable(e)
        return torch.empty(nbytes, dtype=torch.uint8)

    # ------------------------------------------------------------------ backward: back
    def _unpack(self, packed):
        if not isinstance(packed, tuple):
            return packed
        stored, (dtype, offset, size, stride) = packed
        self._fetch(stored)
        at = next((i for i in range(len(self.order) - 1, -1, -1) if self.order[i]() is stored), None)
        if at is not None:  # what backward asks for next: saved just before, in forward
            for ref in self.order[max(0, at - PREFETCH) : at]:
                ahead = ref()
                if ahead is not None:
                    self._fetch(ahead)
        flat = stored.device
        if stored.arrived is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(stored.arrived)
            flat.record_stream(current)
        return torch.empty(0, dtype=dtype, device=flat.device).set_(flat.untyped_storage(), offset, size, stride)

    def _fetch(self, stored: Stored) -> None:
        """The device copy, once per Stored (a second unpack, retain_graph, reuses it)."""
        if stored.device is not None:
            return
        if not self.cuda:
            stored.device = stored.host
            return
        with torch.cuda.stream(self.in_stream):
            self.in_stream.wait_event(stored.done)
            stored.device = stored.host.to(self.device, non_blocking=stored.host.is_pinned())
            stored.arrived = torch.cuda.Event()
            stored.arrived.record(self.in_stream)


def _can_pin() -> bool:
    try:
        torch.empty(1, pin_memory=True)
        return True
    except RuntimeError as e:
        _pageable(e)
        return False


def _pageable(e: BaseException) -> None:
    print(
        f"train.activation_offload: pinned host memory is not available ({str(e).splitlines()[0]}); "
        "offloading to pageable memory (slower copies)",
        file=sys.stderr,
        flush=True,
    )

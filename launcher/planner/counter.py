"""`ActivationCounter`: the bytes autograd saves for backward on a real step, counted with
torch.autograd.graph.saved_tensors_hooks, so the planner's activation terms
(launcher/planner/memory.py) are checked against what autograd really keeps."""

from __future__ import annotations

import weakref

import torch
from torch import nn


class ActivationCounter:
    """Counts the bytes autograd saves for backward, from the first save until the first
    backward use (the end of the first micro-batch's forward, or for a pipeline the
    micro-batches in flight when its first backward starts).

    Each storage counts once (views share it); parameters do not count (they are model
    state), but autocast's weight copies do (they are made per step). It does not see
    op-level recomputation's cache (tests/unit/test_op_recompute.py uses MemTracker).
    Usage: `with ActivationCounter(model) as c: engine.train_step(mbs)`, then c.bytes."""

    def __init__(self, model: nn.Module):
        self.param_ptrs = {_storage(p).data_ptr() for p in model.parameters()}
        self.saved: list[weakref.ref] = []
        self.counting = True
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        if self.counting and not isinstance(t, nn.Parameter):
            self.saved.append(weakref.ref(t))  # autograd holds `t` itself until backward uses it
        return t

    def _close(self) -> None:
        """Bytes autograd still holds when the window closes, each storage once: a tensor
        autograd already let go (a pipeline's shape-inference pass) does not count, nor a
        layer FSDP freed (resized to nothing) after its forward although autograd saved a
        view of it."""
        if self.counting:
            self.counting = False
            live = {}
            for ref in self.saved:
                t = ref()
                if t is not None:
                    st = _storage(t)
                    if st.data_ptr() not in self.param_ptrs:
                        live[st.data_ptr()] = st.nbytes()
            self.bytes = sum(live.values())
            self.saved.clear()

    def _unpack(self, t):
        self._close()
        return t

    def __enter__(self) -> "ActivationCounter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._close()
        self._hooks.__exit__(*exc)


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    local = getattr(t, "_local_tensor", t)  # DTensor: the shard this rank holds
    return local.untyped_storage()

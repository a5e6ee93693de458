"""checkpoint.async_save, the rank side: the host copy a save stops training for, and the
one writer thread that finishes it while training goes on (launcher/rank/checkpoint.py says
what the thread does: write, hash, publish).

    Saver.staged(state)    a host copy of any nesting of tensors (DCP's stager, pinned on
                           CUDA); its buffers are kept and every later save copies into them
    Saver.start(step, fn)  fn on the writer thread; at most one in flight
    Saver.done() / wait()  whether it finished (no communication) / block until it has;
                           what stopped it is raised here, on the main thread
    StagedFiles            a DeepSpeed checkpoint engine whose saves are staged, then written

The writer's collectives run on `group`, a gloo group of its own: collectives of two
threads on one group could pair up wrongly.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from launcher.rank.engine import local_shard


class Saver:
    def __init__(self, timeout: timedelta | None = None):
        self.group = dist.new_group(backend="gloo", timeout=timeout)  # on every rank at the same point
        self.pending: tuple[int, threading.Thread] | None = None  # the step being written, its writer
        self.failure: BaseException | None = None
        self._stager = None

    def stager(self):
        """DCP's stager (what DCP's own async_save takes): host buffers, pinned on CUDA, kept
        for the life of the run: this rank's share of the checkpoint in host memory."""
        # local: start-up (torch.distributed.checkpoint, 3.2 s)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self._stager is None:
            cuda = torch.cuda.is_available()
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda
                )
            )
        return self._stager

    def staged(self, state):
        return self.stager().stage(state)

    def warm(self, engine) -> tuple[int, float]:
        """The engine stages its state once (`Engine.warm`), so that the buffers exist
        before the first save; (their bytes, seconds)."""
        t0 = time.perf_counter()
        seen, total = set(), 0
        for leaf in torch.utils._pytree.tree_leaves(engine.warm(self)):
            if torch.is_tensor(leaf) and (storage := local_shard(leaf).untyped_storage()).data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total, time.perf_counter() - t0

    def start(self, step: int, work) -> None:
        def run() -> None:
            try:
                work()
            except BaseException as err:  # noqa: BLE001 - handed to the main thread as it is
                self.failure = err

        writer = threading.Thread(target=run, daemon=True, name=f"checkpoint-{step}")
        self.pending = (step, writer)
        writer.start()

    def done(self) -> int | None:
        """The step of the save this rank finished since the last call, else None."""
        if self.pending is None or self.pending[1].is_alive():
            return None
        return self.wait()

    def wait(self) -> int | None:
        """Block until the save in flight (if any) has finished; its step, or None when none
        was in flight. Raises what stopped it."""
        if self.pending is None:
            return None
        step, writer = self.pending
        writer.join()
        self.pending = None
        failure, self.failure = self.failure, None
        if failure is not None:
            raise failure
        return step


class StagedFiles:
    """A DeepSpeed checkpoint engine for one async save: DeepSpeed's save runs as ever (its
    collectives, its folders, its bookkeeping), but `save(state, path)` keeps a host copy;
    `write` (on the writer thread) hands each to DeepSpeed's own engine."""

    def __init__(self, own, saver: Saver):
        self.own, self.saver = own, saver
        self.files: list = []

    def __getattr__(self, name):  # everything but save: DeepSpeed's engine
        return getattr(self.own, name)

    def save(self, state_dict, path: str) -> None:
        self.files.append((self.saver.staged(state_dict), path))

    def write(self) -> None:
        for state, path in self.files:
            self.own.save(state, path)
        self.files = []

"""`profile.enabled=true profile.steps=[a,b]`: a torch.profiler trace of steps a..b.

Every rank records its own trace (CPU operators, CUDA kernels on a GPU, input shapes,
allocations) from the start of step a (its data fetch included) to the end of step b and
writes it to RUN_DIR/profile/ through torch's tensorboard_trace_handler, so the file is
Chrome trace JSON (Perfetto, chrome://tracing) named as TensorBoard's profiler plugin
expects (rank<r>.<time>.pt.trace.json). Each step is one `train_step <n>` range in the
trace. On CUDA the allocator's history of the same steps is also dumped as
memory_snapshot_rank<r>.pickle (device.py holds that CUDA-only part).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import torch
from torch.profiler import profile, record_function, tensorboard_trace_handler

from launcher.config import ProfileConfig
from launcher.device import dump_memory_snapshot, profiler_activities, record_memory_history


class StepProfiler:
    """`begin(n)` before step n (counted from 1) fetches its data, `end(n)` after it;
    records only the window."""

    def __init__(self, cfg: ProfileConfig, run_dir: Path, rank: int, device: torch.device):
        self.cfg, self.rank, self.device = cfg, rank, device
        self.first, self.last = cfg.steps if cfg.enabled else (0, -1)
        self.folder = run_dir / "profile"
        self.prof: profile | None = None
        self.memory = False
        self.range: record_function | None = None

    def begin(self, n: int) -> None:
        if self.cfg.enabled and self.prof is None and self.first <= n <= self.last:
            self._start()  # the window's first step, or the first after a resume inside it
        if self.prof is not None:
            self.range = record_function(f"train_step {n}")
            self.range.__enter__()

    def end(self, n: int) -> None:
        if self.range is not None:
            self.range.__exit__(None, None, None)
            self.range = None
        if self.prof is not None and n >= self.last:
            self.finish()

    def _start(self) -> None:
        # Kineto (the profiler's engine) prints a start and a stop line per rank at its highest
        # level ("USDT"); read when it starts. A user's own KINETO_LOG_LEVEL stands.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        self.folder.mkdir(parents=True, exist_ok=True)
        self.memory = record_memory_history(self.device)
        self.prof = profile(
            activities=profiler_activities(self.device),
            record_shapes=self.cfg.record_shapes,
            profile_memory=self.cfg.profile_memory,
            with_stack=self.cfg.with_stack,
        )
        before = torch.empty(16) if self.cfg.profile_memory else None  # a block the profiler did not see allocated
        self.prof.start()
        if before is not None:
            with stderr_to_devnull():
                del before

    def finish(self) -> None:
        """Write what was recorded (also when the run stops inside the window)."""
        if self.prof is None:
            return
        self.prof.stop()
        tensorboard_trace_handler(str(self.folder), worker_name=f"rank{self.rank}")(self.prof)
        if self.memory:
            dump_memory_snapshot(self.device, self.folder / f"memory_snapshot_rank{self.rank}.pickle")
        self.prof, self.memory = None, False


@contextlib.contextmanager
def stderr_to_devnull():
    """With profile_memory, c10's CPU allocator logs "Memory block of unknown size was
    allocated before the profiling started, ..." (CPUAllocator.cpp) at the first free of a
    block allocated before the profiler started, then once per 1,000 such frees (a counter
    in ProfiledCPUMemoryReporter::Delete): every rank printed it at every profiled run,
    although it is expected and says nothing about the run. `StepProfiler._start` spends
    the first on a block of its own while file descriptor 2 points at /dev/null (the
    message comes from C++, below Python's sys.stderr); a few steps free far fewer than
    1,000 blocks from before their window. Only that one `del` runs muted."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)

"""The batches of each step on this rank: the loader from the data position, the step's
micro-batches on the device (under parallel.cp this rank's share of their positions),
the targets the step counts (data=chat) and the time spent waiting for them."""

from __future__ import annotations

import time

from launcher.data.read import SourceMeter, build_loader, micro_batch
from launcher.parallel.context import local_positions
from launcher.parallel.degrees import degrees
from launcher.rank.metrics import PackMeter


class Feed:
    def __init__(self, job, samples_seen: int, say):
        cfg = job.cfg
        self.job = job
        self.global_batch = job.global_batch
        d = degrees(cfg, job.world_size)
        self.cp, self.cp_rank = d.cp, d.cp_rank(job.rank)  # parallel.cp: this rank's T/cp positions of each sample
        self.samples = samples_seen  # the data position of the next step
        self.batches = self._loader()
        self.drawn = SourceMeter(job.dataset, samples_seen, say)  # data/<source>/tokens, epochs run out
        self.packing = PackMeter(job.dataset, samples_seen, job.world_size // job.dp_size, job.preemption.group)
        self.counted: int | None = None
        self.fetched = 0.0

    def _loader(self):
        job = self.job
        return iter(
            build_loader(job.cfg, job.dataset, self.samples, self.global_batch, job.dp_rank, job.dp_size, job.device)
        )

    def take(self) -> list:
        """The next step's micro-batches (job.grad_accum of them); `counted` and `fetched` say
        what the step's losses divide by and how long the data took."""
        t0 = time.perf_counter()
        micro_batches = []
        for _ in range(self.job.grad_accum):
            batch = next(self.batches)
            self.packing.count(batch)  # data=chat: the targets it counts, on the host
            mb = micro_batch(batch.to(self.job.device, non_blocking=True), self.job.cfg.data.document_masking)
            cp = self.cp
            micro_batches.append(tuple(local_positions(t, self.cp_rank, cp) for t in mb) if cp > 1 else mb)
        # data=chat: each loss divides by the step's counted targets (all ranks), not its own
        self.counted = self.packing.step_counted() if self.cp == 1 else None
        self.samples += self.global_batch
        self.fetched = time.perf_counter() - t0
        return micro_batches

    def restart(self) -> None:
        """A new loader from the next step's samples (train.oom_backoff changed the
        micro-batch; this step's samples are in hand)."""
        self.batches = self._loader()

    def metrics(self, step: int) -> dict:
        """At a log step, on every rank: tokens drawn per source, data=chat's packing."""
        return {**self.drawn.metrics(step, self.samples), **self.packing.metrics(self.samples)}

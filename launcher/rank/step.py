"""One optimizer step as the loop sees it: the engine's train_step with what is measured
around it (the straggler spans on log steps, the activations once) and the out-of-memory
back-off, each behind one call."""

from __future__ import annotations

import contextlib

from launcher import models
from launcher.models.gpt import counting
from launcher.planner.memory import ActivationCounter
from launcher.rank import backoff
from launcher.rank.engine import StepResult


class Stepper:
    def __init__(self, job, feed, meter, watchdog, guard, stragglers, log, first: int, last: int):
        self.job, self.feed, self.meter, self.watchdog, self.guard, self.stragglers, self.log = (
            job,
            feed,
            meter,
            watchdog,
            guard,
            stragglers,
            log,
        )
        self.activations = Activations(job.cfg.train.measure_activations, first, last)
        self.skipped = 0  # fp16: steps the loss scaler skipped on overflow, this launch

    def run(self, step: int, micro_batches: list, logged: bool) -> StepResult:
        """Step `step` on this rank's micro-batches: timed for the straggler report where
        `logged`, its activations measured once (train.measure_activations), run again with
        smaller micro-batches after running out of memory (train.oom_backoff)."""
        job, feed = self.job, self.feed
        self.meter.data_wait += feed.fetched
        self.watchdog.in_step()
        self.guard.step = step

        def attempt(batches: list) -> StepResult:
            with (
                self.stragglers.timed(logged, feed.fetched),
                counting(per_call(feed.counted, job, len(batches))),
                self.activations.measured(step, job.engine),
            ):
                return job.engine.train_step(batches)

        result = backoff.stepped(job, step, micro_batches, attempt, feed.restart, self.log)
        self.skipped = self.skipped + result.skipped  # a device tensor stays one: read when logged
        self.meter.steps += 1
        return result


class Activations:
    """train.measure_activations: the bytes autograd saves for backward (and the bytes
    train.activation_offload moved to the host), measured on a launch's second step: the
    first also holds one-time work (a pipeline's shape inference); the planner predicts the
    steady state."""

    def __init__(self, on: bool, first: int, last: int):
        self.step = min(first + 1, last - 1) + 1 if on else None
        self.metrics: dict[str, int] = {}

    @contextlib.contextmanager
    def measured(self, step: int, engine):
        if step != self.step:
            yield
            return
        with ActivationCounter(engine.model) as counter:
            yield
        self.metrics = {"mem/activation_bytes": counter.bytes, **models.offloaded(engine.model)}


def per_call(counted: int | None, job, calls: int) -> float | None:
    """What each of a step's loss calls divides by (launcher/models/gpt.py::COUNTED): the
    step's counted targets over the data-parallel ranks and this rank's loss calls (its
    micro-batches, or a pipeline's own), so the step's gradient is the mean over every
    counted token. None where the data counts every target."""
    if counted is None:
        return None
    p = job.cfg.parallel
    return counted / (job.dp_size * (p.pp_microbatches if p.pp > 1 else calls))

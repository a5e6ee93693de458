"""The loss guard (train.max_bad_steps, train.spike_factor): a step whose gradient norm or
loss is not finite, or whose loss jumps above spike_factor x the recent mean, is skipped
(no optimizer update); after max_bad_steps bad steps in a row the weights and optimizer
state go back to the newest checkpoint and training goes on with the data after the bad
batches (PaLM's remedy for spikes: back to a checkpoint, past the batches around it).

Every rank reaches the same verdict from the same numbers: the gradient norm is global
after clipping (every engine reduces it over the ranks), the loss is all-reduced here.
The loop hands the guard to the engine once (`Engine.guard`); the torch engines ask `admit`
between clipping and the optimizer step; DeepSpeed's engine skips a step whose gradients
are not finite by itself (ZeRO 1-3, fp32 and bf16), so the zero engine asks `judge_loss`
before its last backward and poisons that backward with a NaN when the loss spiked, then
reports what DeepSpeed did with `verdict`. After the step the loop calls `recover`.

A skipped step still counts: the step number, the learning-rate schedule and the data
position go on, so metrics.jsonl and W&B stay monotonic and a resume needs nothing new.
"""

from __future__ import annotations

import math
import sys
from collections import deque

import torch

from launcher.device import host_values
from launcher.exits import EXIT_CHECKPOINT_FAILED
from launcher.rank.engine import owners_sum, set_lrs

WINDOW = 32
"""Applied steps whose losses make the recent mean."""
WARM = 8
"""Losses in the window before a spike can be called."""
FUTILE = 3
"""Rollbacks in a row with no applied step between them before the run stops: the data
after the checkpoint was not the cause."""


class LossGuard:
    def __init__(self, cfg, device: torch.device, slices: int, say=print):
        self.limit = cfg.train.max_bad_steps
        self.factor = cfg.train.spike_factor
        # fp16: a non-finite step is the loss scaler's (it skips and lowers its scale)
        self.scaler_owns_nonfinite = cfg.precision.name.value == "fp16"
        self.device, self.slices, self.say = device, slices, say
        self.recent: deque[float] = deque(maxlen=WINDOW)
        self.step = 0  # the step being decided (the loop sets it)
        self.in_row = self.skipped = self.rollbacks = 0
        self.applied_since_rollback = 0
        self._futile = 0

    @property
    def on(self) -> bool:
        return self.limit > 0

    # ------------------------------------------------------------------ verdicts
    def admit(self, loss: torch.Tensor, owner: bool, grad_norm: torch.Tensor) -> bool:
        """The torch engines, after clipping, before the optimizer step: whether to apply it.
        `loss`: this rank's mean loss of the step; `owner`: whether this rank's loss counts
        (a pipeline's last stage, one per context-parallel group's positions)."""
        if not self.on:
            return True
        mean = self._mean_loss(loss, owner)
        read = host_values(self.device, grad_norm, *(() if mean is None else (mean,)))
        norm, value = read[0], (read[1] if mean is not None else None)
        why = None if math.isfinite(norm) or self.scaler_owns_nonfinite else f"gradient norm {norm}"
        why = why or self._loss_problem(value)
        self.verdict(why, value if math.isfinite(norm) else None)  # fp16's scaler skips that step: not in the mean
        return why is None

    def judge_loss(self, loss: torch.Tensor, owner: bool) -> tuple[str | None, float | None]:
        """The zero engine, before its last backward: (why the step's loss is bad or None,
        the loss). Only with spike_factor (else the gradients alone decide, in DeepSpeed)."""
        if not (self.on and self.factor):
            return None, None
        mean = self._mean_loss(loss, owner)
        value = host_values(self.device, mean)[0]
        return self._loss_problem(value), value

    def verdict(self, why: str | None, loss: float | None = None) -> None:
        """Record the step: applied (`why` None; its loss joins the recent mean) or skipped."""
        if why is None:
            self.in_row = 0
            self.applied_since_rollback += 1
            if loss is not None and math.isfinite(loss):
                self.recent.append(loss)
            return
        self.in_row += 1
        self.skipped += 1
        self.say(
            f"loss guard: step {self.step} skipped ({why}); {self.in_row} in a row, train.max_bad_steps={self.limit}"
        )

    def _mean_loss(self, loss: torch.Tensor, owner: bool) -> torch.Tensor | None:
        """The step's loss over the ranks (one scalar all-reduce), only for spike_factor."""
        if not self.factor:
            return None
        return owners_sum(loss.float(), owner, self.device) / self.slices

    def _loss_problem(self, loss: float | None) -> str | None:
        if loss is None or self.scaler_owns_nonfinite and not math.isfinite(loss):
            return None
        if not math.isfinite(loss):
            return f"loss {loss}"
        if len(self.recent) >= WARM:
            mean = sum(self.recent) / len(self.recent)
            if loss > self.factor * mean:
                return (
                    f"loss {loss:.4g} is {loss / mean:.1f}x the mean of the last {len(self.recent)} steps, "
                    f"above train.spike_factor={self.factor:g}"
                )
        return None

    def metrics(self) -> dict:
        return {"guard/skipped_steps": self.skipped, "guard/rollbacks": self.rollbacks} if self.on else {}

    # ------------------------------------------------------------------ rollback
    def due(self) -> bool:
        return self.on and self.in_row >= self.limit

    def recover(self, engine, saves) -> int | None:
        """After each step: with max_bad_steps bad steps in a row, back to the newest
        checkpoint (the async save in flight published first). The exit code when the run
        must stop instead (no checkpoint, futile rollbacks: 1), else None."""
        if not self.due():
            return None
        if not saves.settle():
            return EXIT_CHECKPOINT_FAILED
        stop = self.roll_back(engine, saves.ckpt, saves.watchdog.paused)
        if stop is None:
            return None
        print(stop, file=sys.stderr, flush=True)
        saves.watchdog.stop()
        return 1

    def roll_back(self, engine, checkpointer, pause) -> str | None:
        """Weights and optimizer state back to the run's newest whole checkpoint (a
        collective: every rank checks its share of the digests); the schedule stays where
        the steps are. Returns why the run must stop instead, or None. `pause`: the
        watchdog's, around the reading."""
        with pause():
            newest = checkpointer.newest_whole(checkpointer.run_id)
        if newest is None:
            return (
                f"loss guard: {self.in_row} bad steps in a row at step {self.step} and no checkpoint "
                "to go back to; stopping (lower optim.lr, or save sooner with checkpoint.every)"
            )
        self._futile = self._futile + 1 if self.applied_since_rollback == 0 else 1
        if self._futile > FUTILE:
            return (
                f"loss guard: {FUTILE} rollbacks in a row, each followed by {self.limit} bad steps and no good "
                f"one; stopping at step {self.step} (the data is not the cause: lower optim.lr)"
            )
        scheduler = engine.scheduler
        schedule = scheduler.state_dict()
        with pause():
            state = checkpointer.load(newest, engine)
        scheduler.load_state_dict(schedule)
        # The optimizer's state brought the checkpoint's learning rates back: the schedule's, as its step() sets them
        set_lrs(scheduler)
        self.in_row = self.applied_since_rollback = 0
        self.rollbacks += 1
        self.say(
            f"loss guard: {self.limit} bad step{'s' * (self.limit > 1)} in a row; weights and optimizer state back to {newest} "
            f"(step {state.step}), going on from step {self.step + 1} with the data after the bad batches"
        )
        return None

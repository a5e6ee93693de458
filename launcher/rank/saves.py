"""The loop's checkpoints: when to save (checkpoint.every, an early stop, the final step, a
stop signal), the async save in flight settled, and a save that could not be written
turned into a clean stop (RUN_DIR/checkpoint_failed.json). The files themselves:
launcher/rank/checkpoint.py."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import torch.distributed as dist

from launcher.exits import CHECKPOINT_FAILED_MARKER, EXIT_CHECKPOINT_FAILED
from launcher.manifest import step_name, whole
from launcher.rank.checkpoint import write_error, write_failure_cause


class Saves:
    def __init__(self, job, watchdog, log, meter, first: int):
        self.job, self.ckpt, self.watchdog, self.log, self.meter = job, job.checkpointer, watchdog, log, meter
        self.first = first
        self.saved_at: Path | None = None

    def warm(self, step: int) -> None:
        """checkpoint.async_save, after the launch's first step, when the optimizer's state
        exists (staging it before would have DCP initialise it with a step of its own): the
        host buffers every save copies into; out of the step times."""
        if self.ckpt.saver is None or step != self.first + 1:
            return
        warmed = self.ckpt.saver.warm(self.job.engine)
        self.log.print(
            f"checkpoint.async_save: {warmed[0] / 2**20:,.0f} MiB of host memory staged in "
            f"{warmed[1]:.1f} s on rank 0 (each save copies into it, then writes in the background)"
        )
        self.meter.start += warmed[1]

    def poll(self) -> int | None:
        """EXIT_CHECKPOINT_FAILED when the async save in flight failed in the background."""
        return None if self.settle(block=False) else EXIT_CHECKPOINT_FAILED

    def due(self, step: int, samples_seen: int, last: int) -> int | None:
        """A checkpoint where one is due (checkpoint.every, an early stop at train.stop_at, the
        last step with checkpoint.save_final): EXIT_CHECKPOINT_FAILED when it could not be
        written, else None."""
        cfg = self.job.cfg
        every = cfg.checkpoint.every
        stopping_early = step == last < cfg.train.steps
        if (every and step % every == 0) or stopping_early or (step == last and cfg.checkpoint.save_final):
            if self.save(step, samples_seen) is None:
                return EXIT_CHECKPOINT_FAILED
            self.meter.start = time.perf_counter()  # keep save time out of the step time
        return None

    def stop(self, step: int, samples_seen: int) -> int | None:
        """A stop signal every rank agreed on: this step's checkpoint published, the marker
        written, then no rank leaves before it exists (under Slurm the first node to exit
        starts the end of the whole step, and the job reads the marker to requeue). None
        when all went well, else the exit code."""
        job = self.job
        if self.saved_at is None or self.saved_at.name != step_name(step):
            if self.save(step, samples_seen) is None:
                return EXIT_CHECKPOINT_FAILED
        if not self.settle():  # the marker names a published checkpoint
            return EXIT_CHECKPOINT_FAILED
        if job.rank == 0:
            job.preemption.write_marker(job.run_dir, step, self.saved_at)
        dist.barrier()
        how = "Ctrl-C" if job.preemption.interrupted else "stop signal"
        self.log.print(
            f"{how}: saved {self.saved_at} after step {step}; "
            f"exiting as {'interrupted' if job.preemption.interrupted else 'preempted'}"
        )
        return None

    def save(self, step: int, samples_seen: int) -> Path | None:
        """A checkpoint (with checkpoint.async_save: staged, and written in the background), or
        None when it could not be written (disk full, folder gone): `failed`."""
        if not self.settle():  # the save before it, if still in flight
            return None
        try:
            with self.watchdog.paused():
                saved = self.ckpt.save(step, samples_seen, self.job.engine)
        except BaseException as err:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            self.failed(err, step)
            return None
        t = self.ckpt.timing
        if self.ckpt.saver is None:
            self.log.print(
                f"checkpoint {saved} (write {t['write_s']:.1f} s, digests {t['digests_s']:.1f} s, "
                f"publish {t['publish_s']:.1f} s)"
            )
        else:
            self.log.print(f"checkpoint {saved}: staged in {t['stage_s']:.1f} s, writing in the background")
        self.saved_at = saved
        return saved

    def settle(self, block: bool = True) -> bool:
        """The async save in flight, if any: wait for it (`block`) or only look whether it is
        done; rank 0 says when it is published. False when it failed (`failed` said why)."""
        saver = self.ckpt.saver
        if saver is None or saver.pending is None:
            return True
        step = saver.pending[0]
        try:
            with self.watchdog.paused() if block else contextlib.nullcontext():
                finished = saver.wait() if block else saver.done()
        except BaseException as err:  # noqa: BLE001 - as in save()
            self.failed(err, step)
            return False
        if finished is not None:
            t = self.ckpt.timing
            self.log.print(
                f"checkpoint {self.ckpt.root / step_name(finished)} written in the background (write "
                f"{t['write_s']:.1f} s, digests {t['digests_s']:.1f} s, publish {t['publish_s']:.1f} s)"
            )
        return True

    def failed(self, err: BaseException, step: int) -> None:
        """A save that could not be written: the rank says so, leaves
        RUN_DIR/checkpoint_failed.json, and the run stops; the last complete checkpoint stays
        as it was. Anything but a failed write is raised as it is."""
        write = write_error(err)
        if write is None:
            raise err
        ckpt, job = self.ckpt, self.job
        cause = write_failure_cause(write, ckpt.root)
        last = (whole(ckpt.root, ckpt.run_id) or [None])[-1]
        message = f"checkpoint at step {step} could not be written on rank {job.rank}: {cause}; stopping. " + (
            f"The last complete checkpoint, {last}, is untouched."
            if last
            else "No complete checkpoint was written before it, so there is nothing to resume."
        )
        print(message, file=sys.stderr, flush=True)
        ckpt.discard_partial(step)
        try:  # the launcher reads it; on a full disk it may stay empty, and the launcher copes
            (job.run_dir / CHECKPOINT_FAILED_MARKER).write_text(
                json.dumps({"message": message, "cause": cause, "step": step}) + "\n"
            )
        except OSError:
            pass  # the run directory may be on the same full disk: the message above stands
        self.watchdog.stop()
        return None

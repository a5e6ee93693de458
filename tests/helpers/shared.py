"""Runs that several tests of a module read, defined by name and launched once, on first use.

    RUNS = {
        "ddp": Run(["recipe=ddp"]),
        "fsdp_from_ddp": Run(["recipe=fsdp"], resume_from="ddp"),
        "stopped": Run(["train.stop_at=6"], then=["train.steps=12"]),
    }

    @pytest.fixture(scope="module")
    def runs(tmp_path_factory) -> SharedRuns:
        return SharedRuns(tmp_path_factory.mktemp("name"), RUNS, common=COMMON, checkpoint=STEP_HALF)

    def test_x(runs):
        run_dir = runs("fsdp_from_ddp")   # launches ddp, then fsdp resumed from ddp's checkpoint

A run that fails is reported once, with its cause (the command, its exit code, the end of
its output), by the first test that needed it. Every later test that needs it, directly or
through `resume_from`, fails in one line naming the run and that first test, without
launching it again: one broken engine shows as one cause, not as the same trace in every
test that reads its run, each after a launch of its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from runs import launch


@dataclass(frozen=True)
class Run:
    """One shared run: what its launch adds to the module's common overrides."""

    overrides: Sequence[str] = ()
    resume_from: str | None = None
    """Another run's name: this one starts from its checkpoint (SharedRuns.checkpoint)."""
    then: Sequence[Sequence[str]] = ()
    """Later launches in the same run directory (a relaunch, a resume), each its own overrides."""
    timeout: int = 600
    extra: dict = field(default_factory=dict)
    """Whatever else a module's tests read about the run (an expected value, a label)."""


class SharedRuns:
    """name -> the run directory of RUNS[name], launched on first use (module docstring).
    Launch i's stdout is kept as run_dir/stdout{i}.txt (1 the first)."""

    def __init__(
        self,
        root: Path,
        runs: dict[str, Run],
        common: Sequence[str] = (),
        checkpoint: str | None = None,
        launcher: Callable[..., object] = launch,
    ):
        self.root, self.runs, self.common, self.checkpoint = root, runs, tuple(common), checkpoint
        self.launcher = launcher
        self.done: dict[str, Path] = {}
        self.failed: dict[str, str] = {}  # name -> the test that reported its cause

    def __call__(self, name: str) -> Path:
        if name in self.failed:
            pytest.fail(
                f"shared run {name!r} failed; its cause is reported once, by {self.failed[name]}", pytrace=False
            )
        if name not in self.done:
            try:
                self.done[name] = self._launch(name, self.runs[name])
            except BaseException:
                self.failed[name] = os.environ.get("PYTEST_CURRENT_TEST", "the first test that needed it").split(" ")[0]
                raise
        return self.done[name]

    __getitem__ = __call__  # runs["ddp"] reads as the dict of run directories it replaces

    def items(self) -> list[tuple[str, Path]]:
        """Every run, launched where it is not yet, in the order RUNS names them."""
        return [(name, self(name)) for name in self.runs]

    def values(self) -> list[Path]:
        return [run for _, run in self.items()]

    def _launch(self, name: str, run: Run) -> Path:
        run_dir = self.root / name
        first = list(run.overrides)
        if run.resume_from is not None:
            source = self(run.resume_from)
            first.append(f"checkpoint.resume={source / self.checkpoint if self.checkpoint else source}")
        for i, overrides in enumerate([first, *run.then], start=1):
            proc = self.launcher(*self.common, *overrides, run_dir=run_dir, timeout=run.timeout)
            (run_dir / f"stdout{i}.txt").write_text(getattr(proc, "stdout", "") or "")
        return run_dir

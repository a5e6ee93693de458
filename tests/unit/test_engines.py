"""The engine contract (launcher/rank/engine.py::Engine): every engine the registry names
keeps it, the checker finds what breaks it, and the hooks an engine leaves out have their
defaults."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import torch
from torch import nn

import engines
from launcher.rank.engine import UNGUARDED, Engine, MemoryBreakdown, StepResult, check


def engine_classes() -> dict[type, list[str]]:
    """Each engine class, from the registry: the class that `build` returns (its annotation)
    in the module each engine's spec names, with the engines (engines/ modules) it runs."""
    out: dict[type, list[str]] = {}
    for name in engines.names():
        hints = typing.get_type_hints(engines.engine(name).build)
        assert "return" in hints, f"engines/{name}: annotate build(ctx) with the engine class it returns"
        out.setdefault(hints["return"], []).append(name)
    return out


def test_every_engine_of_the_registry_keeps_the_contract():
    classes = engine_classes()
    assert sum(len(names) for names in classes.values()) == len(engines.names())
    for cls, names in classes.items():
        assert check(cls) == [], (names, check(cls))


class Minimal(Engine):
    """The abstract methods alone."""

    def __init__(self):
        self.model = nn.Linear(2, 2)

    def train_step(self, micro_batches):
        return StepResult(loss=torch.zeros(()), grad_norm=torch.zeros(()))

    def eval_step(self, micro_batches):
        return self.train_step(micro_batches)

    def state_bytes(self):
        return MemoryBreakdown()

    def lr(self):
        return 0.0

    def save(self, path: Path, staging=None):
        return None

    def warm(self, staging):
        return None

    def load(self, path: Path) -> None:
        pass

    def consolidated_state_dict(self):
        return {}


def test_the_hooks_an_engine_leaves_out_have_their_defaults():
    engine = Minimal()
    assert check(Minimal) == []
    assert engine.output_module is engine.model and list(engine.stages) == []
    assert engine.guard is UNGUARDED and engine.guard.admit(torch.tensor(float("nan")), True, torch.zeros(()))
    assert engine.guard.judge_loss(torch.zeros(()), True) == (None, None)
    assert not engine.can_discard_step()
    with pytest.raises(NotImplementedError, match="Minimal cannot drop a failed step"):
        engine.discard_step()


def test_the_checker_names_what_breaks_the_contract():
    class Unfinished(Engine):
        def train_step(self, micro_batches):
            raise AssertionError

    class OldStep(Minimal):
        def train_step(self, micro_batches, guard=None):  # the guard is the engine's own attribute now
            raise AssertionError

    class PlainOutput(Minimal):
        output_module = None

    class Elsewhere:
        pass

    assert check(Elsewhere) == [f"{Elsewhere!r} is not a subclass of launcher.rank.engine.Engine"]
    assert "Unfinished.lr is not implemented" in check(Unfinished) and len(check(Unfinished)) == 7
    assert check(OldStep) == [
        "OldStep.train_step(self, micro_batches, guard=None): the contract says "
        "train_step(self, micro_batches: 'list[Batch]') -> 'StepResult'"
    ]
    assert check(PlainOutput) == ["PlainOutput.output_module: a property in the contract, not here, or the reverse"]
    with pytest.raises(TypeError, match="abstract"):
        Unfinished()

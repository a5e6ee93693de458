"""tests/helpers/shared.py: a shared run that fails is reported once, with its cause."""

from __future__ import annotations

import pytest
from runs import launch
from shared import Run, SharedRuns


def test_a_failed_shared_run_is_reported_once_and_never_relaunched(tmp_path):
    launched = []

    def counted(*overrides, **kw):
        launched.append(overrides)
        return launch(*overrides, **kw)

    runs = SharedRuns(
        tmp_path,
        {"broken": Run(["model=nope"]), "resumed": Run(["train.steps=2"], resume_from="broken")},
        checkpoint="checkpoints/step_00000001",
        launcher=counted,
    )
    with pytest.raises(AssertionError) as first:
        runs("broken")
    assert "exited 2" in str(first.value) and "model=nope" in str(first.value)  # the cause, once
    for name in ("broken", "resumed"):
        with pytest.raises(pytest.fail.Exception) as later:
            runs(name)
        message = str(later.value)
        assert "shared run 'broken' failed" in message and "test_shared_runs.py::" in message
        assert len(message.splitlines()) == 1
    assert len(launched) == 1  # neither the broken run again nor the one that resumes from it

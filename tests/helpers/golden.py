"""Golden files (tests/golden/): expected commands, scripts and DeepSpeed configs.
`UPDATE_GOLDEN=1 make test-quick` rewrites them after an intended change; review the diff."""

from __future__ import annotations

import os

from runs import REPO

GOLDEN = REPO / "tests" / "golden"


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"missing golden file {path}; run with UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{name} differs from its golden file"

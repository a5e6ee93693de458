"""Crafted checkpoint files: each would run a command (touch a marker) if unpickled."""

from __future__ import annotations

import dataclasses
import os
import pickle
from pathlib import Path


class Payload:
    """Runs `touch marker` when unpickled by anything that honours __reduce__."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def craft_metadata(folder: Path, marker: Path, **change) -> None:
    """Rewrite folder/.metadata: DCP's own metadata, with `change` applied and a payload in
    a field torch never looks at."""
    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own file, just written
    metadata = dataclasses.replace(metadata, **change)
    metadata.planner_data = Payload(marker)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)

"""pytest's shared fixtures; the helpers the tests import are in tests/helpers/ (on the path).

    tests/unit/     in-process checks and quick commands: `make test-quick`
    tests/e2e/      real multi-process runs (torchrun, DeepSpeed, Slurm, signals): with unit, `make test`
    tests/helpers/  what the tests share: launching runs, tiny Hugging Face models, W&B files, Slurm
    tests/golden/   expected commands and scripts; tests/data/: small input files
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"

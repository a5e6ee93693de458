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


@pytest.fixture(scope="session", autouse=True)
def data_cache(tmp_path_factory):
    """The shared cache of prepared data (data.cache_dir's default) for every test and the
    runs they launch: a folder of the session's, never the user's ~/.cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LAUNCHER_DATA_CACHE", str(tmp_path_factory.mktemp("data-cache")))
        yield


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture
def one_rank_group(tmp_path):
    """A real gloo process group of one rank (a file store in tmp_path)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()

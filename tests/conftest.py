"""pytest's shared fixtures; the helpers the tests import are in tests/helpers/ (on the path).

tests/unit/     in-process checks and quick commands: `make test-quick`
tests/e2e/      real multi-process runs (torchrun, DeepSpeed, Slurm, signals): with unit, `make test`
tests/helpers/  what the tests share: launching runs, tiny Hugging Face models, W&B files, Slurm
tests/golden/   expected commands and scripts; tests/data/: small input files
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))


def share_the_cores() -> None:
    """Under `pytest -n N` each worker's processes get cores / N threads (OMP_NUM_THREADS,
    which the launcher keeps for its ranks as torchrun does), unless the shell set it: N
    workers of a machine's whole thread count each would make 2N threads on N cores, whose
    OpenMP workers spin for the cores instead of computing."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        from launcher.host import usable_cores

        threads = max(1, usable_cores() // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(threads)


share_the_cores()


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

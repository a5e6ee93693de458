"""The Makefile's set-up on a fresh clone, as `make -n` prints it (nothing is installed).

A copy of the Makefile and pyproject.toml in an empty folder is a clone with no .venv, so the
setup recipe is what make would run first. `.ci/run` calls `make wheelhouse WHEELHOUSE=<dir>`
on such a clone: there WHEELHOUSE names the folder being written, so the set-up must install
online (it refused once, looking for <dir>/requirements.txt before the wheels existed).
"""
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def clone(tmp_path):
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(REPO / name, tmp_path / name)
    return tmp_path


def dry(clone, *args):
    proc = subprocess.run(["make", "-n", *args], cwd=clone, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_make_wheelhouse_on_a_fresh_clone_sets_up_online(clone):
    out = dry(clone, "wheelhouse", "WHEELHOUSE=.ci/wheelhouse", "EXTRAS=dev")
    assert "pip install --quiet -e '.[dev,hf,tb,fp8,k8s]'" in out
    assert "--no-index" not in out and "requirements.txt" not in out
    assert "scripts/wheelhouse.py --out '.ci/wheelhouse'" in out and "--extras 'dev'" in out


def test_make_setup_with_a_wheelhouse_installs_from_it_offline(clone):
    out = dry(clone, "setup", "WHEELHOUSE=/shared/wheels", "TORCH=system")
    assert "test -f '/shared/wheels/requirements.txt'" in out
    assert "--no-index --find-links '/shared/wheels' -r '/shared/wheels/requirements.txt'" in out
    assert "system-torch.pth" in out
    assert "pip install --quiet -e '.[dev,hf,tb,fp8,k8s]'" not in out

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
    assert "pip install --quiet -e '.[hf,tb,dev,fp8,k8s]'" in out  # what the wheelhouse may hold is installed
    assert "--no-index" not in out and "requirements.txt" not in out
    assert "scripts/wheelhouse.py --out '.ci/wheelhouse'" in out and "--extras 'dev'" in out


def test_make_setup_with_a_wheelhouse_installs_from_it_offline(clone):
    out = dry(clone, "setup", "WHEELHOUSE=/shared/wheels", "TORCH=system")
    assert "test -f '/shared/wheels/requirements.txt'" in out
    assert "--no-index --find-links '/shared/wheels' -r '/shared/wheels/requirements.txt'" in out
    assert "system-torch.pth" in out
    assert "pip install --quiet -e '.[" not in out


def test_the_first_run_installs_what_it_runs_and_the_tests_the_rest(clone):
    """Issue 48: set-up took 7 minutes, 4.6 of them compiling DeepSpeed ops the default run
    never loads, and installed pytest, torchao (fp8: GPUs of compute capability 8.9+) and the
    Kubernetes schemas (108 MB, tests only). `make train` installs the project with hf and tb
    (fine-tuning finds peft and accelerate) and compiles nothing; `make test` adds the rest and
    the ops (the suite runs every ZeRO recipe); BUILD_OPS=1 compiles them at set-up."""
    train = dry(clone, "train")
    assert "pip install --quiet -e '.[hf,tb]'" in train
    assert "build_ops.py" not in train and "dev" not in train and "fp8" not in train and "k8s" not in train
    assert "scripts/build_ops.py" in dry(clone, "setup", "BUILD_OPS=1")
    test = dry(clone, "test")
    assert "pip install --quiet -e '.[hf,tb,dev,fp8,k8s]'" in test and "scripts/build_ops.py" in test
    assert "scripts/build_ops.py" not in dry(clone, "test", "BUILD_OPS=0")
    import tomllib

    extras = tomllib.loads((clone / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    first = [req.split(">=")[0] for extra in ("hf", "tb") for req in extras[extra]]
    assert {"transformers", "peft", "accelerate", "datasets", "tokenizers"} <= set(first)
    assert not {"torchao", "kubernetes-validate", "pytest"} & set(first)

"""`make setup WHEELHOUSE=<dir> TORCH=system` on a node without network, over a site's own
torch: a clean copy of the project installs from the wheelhouse with pip unable to reach
any index, keeps the torch the system Python imports, and trains.

The wheelhouse comes from `make wheelhouse` (network), which .ci/run makes before the suite
(LAUNCHER_WHEELHOUSE=<dir>); without one the test is skipped with that reason. The site's
torch is this environment's torch, seen by a bare interpreter through a folder that holds
only torch and what it imports (as a cluster's module or container provides it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from runs import REPO

WHEELHOUSE = os.environ.get("LAUNCHER_WHEELHOUSE")
# torch and what `import torch` reads at once, with their metadata (the launcher reads torch's version)
SITE_TORCH = (
    "torch",
    "torchgen",
    "functorch",
    "typing_extensions",
    "filelock",
    "sympy",
    "mpmath",
    "networkx",
    "jinja2",
    "markupsafe",
    "fsspec",
)
NO_NETWORK = {
    "PIP_CONFIG_FILE": os.devnull,
    "PIP_FIND_LINKS": "",
    "PIP_EXTRA_INDEX_URL": "",
    "https_proxy": "http://proxy.invalid:9",
    "http_proxy": "http://proxy.invalid:9",
    "HTTPS_PROXY": "http://proxy.invalid:9",
    "HTTP_PROXY": "http://proxy.invalid:9",
}


def site_torch(folder: Path) -> Path:
    """A bare interpreter that imports torch from `folder` (links to this environment's
    torch and its imports, nothing else): the 'system' Python of a cluster."""
    here = Path(sysconfig.get_paths()["purelib"])
    folder.mkdir()
    for entry in here.iterdir():
        top = entry.name.split("-")[0].lower()
        if top in SITE_TORCH or entry.name.removesuffix(".py").lower() in SITE_TORCH:
            (folder / entry.name).symlink_to(entry)
    python = folder.parent / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={folder} exec {sys._base_executable} "$@"\n')
    python.chmod(0o755)
    return python


@pytest.mark.slow
@pytest.mark.skipif(
    not WHEELHOUSE, reason="no wheelhouse: LAUNCHER_WHEELHOUSE=<dir> from make wheelhouse (.ci/run makes one)"
)
def test_an_offline_setup_keeps_the_site_torch_and_trains(tmp_path):
    clone = tmp_path / "clone"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, (f.decode() for f in files)):
        if (REPO / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            (clone / name).write_bytes((REPO / name).read_bytes())
    python = site_torch(tmp_path / "site-packages")
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "VIRTUAL_ENV")},
        **NO_NETWORK,
    }
    setup = subprocess.run(
        ["make", "setup", f"WHEELHOUSE={WHEELHOUSE}", "TORCH=system", f"PYTHON={python}", "BUILD_OPS=0"],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert setup.returncode == 0, setup.stdout[-3000:] + setup.stderr[-5000:]
    venv_python = clone / ".venv" / "bin" / "python"
    where = subprocess.run(
        [
            str(venv_python),
            "-c",
            "import json, torch, deepspeed, hydra, launcher; print(json.dumps("
            "[torch.__file__, deepspeed.__file__, launcher.__file__]))",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    torch_file, deepspeed_file, launcher_file = json.loads(where.splitlines()[-1])
    assert torch_file.startswith(str(tmp_path / "site-packages")), torch_file  # the site's torch, kept
    assert deepspeed_file.startswith(str(clone / ".venv")) and launcher_file.startswith(str(clone))
    run = tmp_path / "run"
    train = subprocess.run(
        [
            str(venv_python),
            "-m",
            "launcher",
            "train",
            f"hydra.run.dir={run}",
            "train.steps=2",
            "optim.warmup_steps=0",
            "logger=none",
            "checkpoint.every=0",
        ],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    assert json.loads((run / "summary.json").read_text())["steps_this_launch"] == 2

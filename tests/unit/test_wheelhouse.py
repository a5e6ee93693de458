"""scripts/wheelhouse.py's requirements.txt: pinned to the tested versions, except what the
node's own torch requires too (the H200's torch 2.11 came with setuptools 81 and refused the
84 pinned here: `make setup WHEELHOUSE=... TORCH=system` stopped on the conflict)."""

import sys
from importlib import metadata

from runs import REPO

sys.path.insert(0, str(REPO / "scripts"))
import wheelhouse  # noqa: E402

PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


def test_what_torch_requires_is_left_to_the_nodes_torch_and_the_rest_is_pinned():
    needed = wheelhouse.needed_without_torch(wheelhouse.project_requirements(["dev", "hf"]), PYTHON)
    lines = dict(line.strip().partition("==")[::2] for line in wheelhouse.requirement_lines(needed, PYTHON))
    assert set(lines) == set(needed) and "torch" not in lines
    torch_side = set(wheelhouse.needed_without_torch(["torch"], PYTHON, stop=()))
    unpinned = {name for name, version in lines.items() if not version}
    assert unpinned == set(needed) & torch_side and "setuptools" in unpinned
    for name in ("hydra-core", "omegaconf", "deepspeed", "setuptools"):
        assert name in lines
    assert lines["hydra-core"] == metadata.version("hydra-core") and lines["deepspeed"] == metadata.version("deepspeed")

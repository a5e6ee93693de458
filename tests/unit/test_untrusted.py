"""A checkpoint is data, never code, file by file: crafted DCP metadata and torch.save
archives are refused before anything in them runs (launcher/untrusted.py,
launcher/parallel/dcp.py's SafeReader). Each crafted file would run a command (touch a
marker) if unpickled. Real runs' checkpoints, crafted: tests/e2e/test_untrusted_runs.py."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp_api
from crafted import Payload, craft_metadata
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from launcher import untrusted
from launcher.parallel import dcp


def dcp_folder(folder: Path) -> Path:
    sd = {"model": {"w": torch.randn(4, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}}
    dcp_api.save(sd, checkpoint_id=str(folder), no_dist=True)
    return folder


# ----------------------------------------------------------------------------- files
def test_crafted_dcp_metadata_runs_code_in_torch_and_not_here(tmp_path):
    folder, marker = dcp_folder(tmp_path / "ckpt"), tmp_path / "ran"
    assert dcp.read_metadata(folder).state_dict_metadata  # the genuine file passes
    assert untrusted.check_checkpoint(folder) is None
    craft_metadata(folder, marker)
    FileSystemReader(str(folder)).read_metadata()  # what torch's reader does with it
    assert marker.exists()  # the attack is real
    marker.unlink()
    with pytest.raises(dcp.CheckpointRefused, match="posix.system"):
        dcp.read_metadata(folder)
    with pytest.raises(BaseException) as refused:  # DCP wraps it in a CheckpointException (a BaseException)
        dcp_api.load(
            {"model": {"w": torch.empty(4, 3), "b": torch.empty(3, dtype=torch.bfloat16)}},
            storage_reader=dcp.SafeReader(folder),
            no_dist=True,
        )
    assert "must never run code" in str(getattr(refused.value, "failures", refused.value))
    problem = untrusted.check_checkpoint(folder)
    assert "posix.system" in problem and "\n" not in problem and not marker.exists()


def test_dcp_entries_that_are_not_tensors_or_point_outside_are_refused(tmp_path):
    folder = dcp_folder(tmp_path / "bytes")
    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    metadata.state_dict_metadata["model.w"] = BytesStorageMetadata()  # DCP would torch.load(weights_only=False) it
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(dcp.CheckpointRefused, match="not a tensor"):
        dcp.read_metadata(folder)

    folder = dcp_folder(tmp_path / "outside")
    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    for info in metadata.storage_data.values():
        info.relative_path = "../../etc/passwd"
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(dcp.CheckpointRefused, match="outside its folder"):
        dcp.read_metadata(folder)

    (folder / ".metadata").write_bytes(b"\x80\x04not a pickle")
    with pytest.raises(dcp.CheckpointRefused, match="not readable"):
        dcp.read_metadata(folder)


def test_torch_save_archives_are_checked_without_unpickling(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"step": 3, "rng": torch.get_rng_state(), "nested": [1.5, {"a": torch.ones(2)}]}, tmp_path / "ok.pt")
    assert untrusted.check_file(tmp_path / "ok.pt") is None
    torch.save({"step": 3, "x": Payload(marker)}, tmp_path / "bad.pt")
    problem = untrusted.check_file(tmp_path / "bad.pt")
    assert "posix.system" in problem and "\n" not in problem and not marker.exists()
    raw = pickle.dumps(Payload(marker))  # a legacy, non-zip pickle, and one with a zip appended
    (tmp_path / "raw.pt").write_bytes(raw)
    (tmp_path / "disguised.pt").write_bytes(raw + (tmp_path / "ok.pt").read_bytes())
    for name in ("raw.pt", "disguised.pt"):
        assert "cannot be checked" in untrusted.check_file(tmp_path / name)
    assert not marker.exists()

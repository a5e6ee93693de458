"""Checkpoint files are data, never code: what resume and export read is checked here,
on the launch side, before any rank starts, and read by the ranks with loaders that cannot
run code (launcher/parallel/dcp.py's SafeReader, `torch.load(weights_only=True)`).

A pickle runs code through the callables it names. For a `torch.save` archive, torch's
own static reader (`torch.serialization.get_unsafe_globals_in_checkpoint`: the same zip
reader and record torch.load uses, no unpickling) lists the names that weights_only
loading would not allow; DeepSpeed's four types are allowed besides (`weights_only_loads`
below admits exactly these). DCP's `.metadata` is a plain pickle, read by
launcher/parallel/dcp.py::read_metadata's restricted unpickler. The manifest's digests do not help
here: whoever crafts a file can rewrite them.

    problem = check_checkpoint(folder)   # None, or one line naming the file and the name
"""

from __future__ import annotations

import contextlib
import importlib
import os
from pathlib import Path

# The types DeepSpeed pickles into its checkpoint files beside tensors (`weights_only_loads`
# allows exactly these under weights_only loading).
DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
)

REFUSE = "refusing to load it (a checkpoint must never run code)"


def check_file(path: Path) -> str | None:
    """None when `path` can be read without running code; else one line why not."""
    if path.name == ".metadata":
        from launcher.parallel import dcp  # local: side (launch -> rank)

        try:
            dcp.read_metadata(path.parent)
        except dcp.CheckpointRefused as e:
            return str(e)
        return None
    import torch  # local: torch (launch side)

    try:
        unsafe = sorted(set(torch.serialization.get_unsafe_globals_in_checkpoint(str(path))) - set(DEEPSPEED_GLOBALS))
    except Exception as e:  # noqa: BLE001 -- not a torch.save archive, torn, encrypted, ...
        return (
            f"{path} cannot be checked ({e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''}); {REFUSE}"
        )
    if unsafe:
        return f"{path} would call {unsafe[0]}, which a checkpoint never contains: {REFUSE}"
    return None


# torch.save archives and DCP metadata; DCP's *.distcp tensor data are read with
# weights_only=True by torch's own reader, safetensors and JSON are not pickle.
_PICKLED = {".pt", ".pth", ".bin", ".ckpt"}


def check_checkpoint(folder: Path) -> str | None:
    """The first file in a checkpoint folder that reading could make run code, as one line.
    A symbolic link inside it is refused: a checkpoint holds its own files (the save never
    makes a link), and a linked folder would hide its files from this walk."""
    for root, dirs, files in os.walk(folder):  # links are listed, never followed
        link = next((Path(root) / n for n in sorted(dirs + files) if (Path(root) / n).is_symlink()), None)
        if link is not None:
            return f"{link} is a symbolic link (to {os.readlink(link)}), which a checkpoint never holds: {REFUSE}"
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        if path.suffix in _PICKLED or path.name == ".metadata":
            problem = check_file(path)
            if problem:
                return problem
    return None


# ----------------------------------------------------------------------------- DeepSpeed's files
def _safe_globals() -> list:
    """The non-tensor types DeepSpeed pickles into its checkpoint files
    (launcher.untrusted.DEEPSPEED_GLOBALS, which the launch side's check allows too);
    nothing else may load."""
    out = []
    for name in DEEPSPEED_GLOBALS:
        module, attr = name.rsplit(".", 1)
        out.append(getattr(importlib.import_module(module), attr))
    return out


@contextlib.contextmanager
def weights_only_loads():
    """Every torch.load DeepSpeed makes in this block runs with weights_only=True (it passes
    weights_only=False itself; TORCH_FORCE_WEIGHTS_ONLY_LOAD overrides that), allowing only
    the DeepSpeed types listed in `_safe_globals`."""
    import torch  # local: torch (launch side)

    previous = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            yield
    finally:
        if previous is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = previous

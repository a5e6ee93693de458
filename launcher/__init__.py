"""launcher: a distributed training launcher for PyTorch (see README.md)."""

import logging
import os as _os

USER_ENV: dict[str, str] = dict(_os.environ)
"""The environment this process started with, before any module of ours set a variable."""

SET_HERE = (
    "DS_ACCELERATOR",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "HF_HUB_DISABLE_TELEMETRY",
    "HF_HUB_DISABLE_PROGRESS_BARS",
)
"""What the launch side sets for this machine (DeepSpeed's accelerator, found here; the
hubs off): never handed on to a Slurm job, which runs on other machines."""


def user_env() -> dict[str, str]:
    """This process's environment less what the launcher set for itself: each of SET_HERE
    as the process started with it, or absent."""
    env = dict(_os.environ)
    for key in SET_HERE:
        if key in USER_ENV:
            env[key] = USER_ENV[key]
        else:
            env.pop(key, None)
    return env


def offline() -> None:
    """Nothing is downloaded at run time: the hub libraries stay on local files, without
    progress bars in every rank's log. Called by the entry points (the launcher, a rank)
    and before this project's first import of transformers; never when a module is
    imported. Before huggingface_hub is imported: it reads these once."""
    _os.environ.update(
        HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1"
    )
    _os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    quiet_imports()


IMPORT_NOISE = {
    # torchao's CUDA kernels (mxfp8, CUTLASS) where they cannot load (no CUDA, another
    # Python's build): precision=fp8 uses its Python float8, which loads. transformers
    # imports torchao whenever it is installed: every model=hf run, export and plan.
    "torchao": ("Failed to load ",),
    # torchao registers its Enums with torch's pytree, which torch 2.13 deprecates.
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported",),
}
"""Log lines libraries print when imported that tell a user nothing (12 lines on every
model=hf run, export and plan, issue 48): logger name -> the messages dropped."""


def quiet_imports() -> None:
    """Drop IMPORT_NOISE's lines at their loggers (a filter on each; their other messages
    pass). Called by offline(), so before any import of transformers or torchao of ours."""
    for name, starts in IMPORT_NOISE.items():
        logger = logging.getLogger(name)
        if not any(getattr(f, "drops", None) == starts for f in logger.filters):
            logger.addFilter(_Drop(starts))


class _Drop:
    """A logging filter: records whose message holds one of `drops` go no further."""

    def __init__(self, drops: tuple[str, ...]):
        self.drops = drops

    def filter(self, record) -> bool:
        message = str(record.msg)
        return not any(d in message for d in self.drops)

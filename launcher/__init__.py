"""launcher: a distributed training launcher for PyTorch (see README.md)."""
import os as _os

USER_ENV: dict[str, str] = dict(_os.environ)
"""The environment this process started with, before any module of ours set a variable."""

SET_HERE = ("DS_ACCELERATOR", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE",
            "HF_HUB_DISABLE_TELEMETRY", "HF_HUB_DISABLE_PROGRESS_BARS")
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
    _os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                       HF_HUB_DISABLE_TELEMETRY="1")
    _os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

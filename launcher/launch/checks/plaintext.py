"""Every text value of a config is one line of printable characters.

Values reach command.sh, job.sbatch, the hostfile and DeepSpeed's ssh/pdsh command lines.
Quoting keeps `a; touch x` data there, but no quoting survives a line break in a file that
is parsed line by line (sbatch reads every `#SBATCH` line of the script, also one that a
value's newline starts inside a quoted job name). So a control character (a line break, a
tab, NUL, ESC, ...) anywhere in the config is refused before anything is written.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from pathlib import Path

from launcher import config as C

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check(cfg: C.Config) -> None:
    """ConfigError naming the first value (by its dotted key) that holds a control character."""
    for key, text in _texts(cfg, ""):
        if _CONTROL.search(text):
            raise C.ConfigError(
                key,
                repr(text),
                "one line of printable characters: line breaks, tabs and other "
                "control characters are refused (values reach command.sh and job.sbatch)",
            )


def _texts(value, key: str):
    if isinstance(value, enum.Enum):
        return
    if isinstance(value, (str, Path)):
        yield key, str(value)
    elif dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            yield from _texts(getattr(value, f.name), f"{key}.{f.name}" if key else f.name)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield f"{key}.{k}", str(k)
            yield from _texts(v, f"{key}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _texts(v, f"{key}[{i}]")


_REMOTE_PLAIN = re.compile(r"[\w@%+=:,./-]*")


def check_remote_shell(cfg: C.Config, run_dir: Path, workdir: str) -> None:
    """cluster.runner=deepspeed on several nodes: DeepSpeed's runner joins the command it
    sends over pdsh/ssh without shell quoting (`cd <cwd>;`, the run directory as an argument,
    `export NCCL_X="<value>"`, where `$(...)` still runs). Only words that need no quoting
    may go there: refused otherwise, naming the value."""
    if cfg.cluster.runner != C.Runner.deepspeed or cfg.cluster.nnodes <= 1:
        return
    why = (
        "DeepSpeed's multi-node runner passes it to a remote shell unquoted: letters, digits and @%+=:,./_- only "
        "(or cluster.runner=torchrun)"
    )
    for key, text in [
        ("hydra.run.dir", str(run_dir)),
        ("the working directory", workdir),
        *((f"cluster.env.{k}", v) for k, v in cfg.cluster.env.items()),
    ]:
        if not _REMOTE_PLAIN.fullmatch(text):
            raise C.ConfigError(key, text, why)

"""What produced a run, written by every launch (`make train`) and submit into the run directory:

    RUN_DIR/provenance/<UTC time>-node<k>/provenance.json   the command as typed, where, when, the versions
                                         /requirements.txt  every installed distribution, name==version (pip freeze's content)
                                         /git.diff          the uncommitted changes of the project's checkout, when it has any
    RUN_DIR/provenance.json                                 node 0's latest record: what W&B's config carries

A run launched again keeps the records of its earlier launches beside the new one, so a
checkpoint can be traced to the code that wrote it. Every start of the ranks, also one
without the launcher (command.sh run again, a Slurm job and its requeues), appends to
RUN_DIR/provenance/hosts.jsonl the host of every rank, where the ranks imported the project
from, and that code's git commit (RUN_DIR/code, a Slurm job's snapshot, has none of its own:
the submit's record has it); on Slurm the ranks run on nodes the submitting machine never sees. Nothing here is needed to train: a record that cannot be taken (no
git, an odd checkout) says why in its place and the launch goes on.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

FOLDER = "provenance"
LATEST = "provenance.json"
HOSTS = "hosts.jsonl"  # one line per start of the ranks: {time, world, hosts: {host: [ranks]}, code, git, versions}
PROJECT = Path(__file__).resolve().parents[1]  # the checkout (or install) this launcher runs from
# The packages a run's numbers depend on, by distribution name (read without importing them).
KEY_PACKAGES = ("torch", "deepspeed", "transformers", "torchao", "hydra-core", "omegaconf", "wandb", "numpy")
MAX_DIFF_BYTES = 8 * 2**20  # a larger diff is cut there, and the record says so
MAX_LISTED = 200  # untracked files named in the record


def _git(*args: str) -> str:
    out = subprocess.run(["git", "-C", str(PROJECT), *args], capture_output=True, text=True, timeout=20, check=True)
    return out.stdout


def git_state(with_diff: bool = True) -> tuple[dict, str]:
    """({commit, branch, dirty, untracked} or {error}, the diff of tracked files against HEAD)."""
    try:
        top = _git("rev-parse", "--show-toplevel").strip()
        if (
            Path(top).resolve() != PROJECT.resolve()
        ):  # e.g. a job's RUN_DIR/code inside a run directory inside a checkout
            return {"error": f"{PROJECT} is not a git checkout of its own (it lies inside {top})"}, ""
        commit = _git("rev-parse", "HEAD").strip()
        branch = _git("rev-parse", "--abbrev-ref", "HEAD").strip()
        status = _git("status", "--porcelain", "--untracked-files=normal").splitlines()
        diff = _git("diff", "HEAD", "--no-ext-diff") if status and with_diff else ""  # binary files: named only
    except (OSError, subprocess.SubprocessError) as e:
        why = stderr.strip().splitlines()[-1] if (stderr := getattr(e, "stderr", None)) else str(e)
        return {"error": f"no git state of {PROJECT}: {why}"}, ""
    untracked = [line[3:] for line in status if line.startswith("??")]
    state = {"commit": commit, "branch": branch, "dirty": bool(status), "untracked": untracked[:MAX_LISTED]}
    if len(untracked) > MAX_LISTED:
        state["untracked_not_listed"] = len(untracked) - MAX_LISTED
    if len(diff.encode()) > MAX_DIFF_BYTES:
        diff = diff.encode()[:MAX_DIFF_BYTES].decode(errors="ignore")
        state["diff_cut_at_bytes"] = MAX_DIFF_BYTES
    return state, diff


def installed() -> list[str]:
    """name==version of every distribution this Python sees, sorted, as pip freeze lists them."""
    seen = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name and name.lower() not in seen:
            seen[name.lower()] = f"{name}=={dist.version}"
    return [seen[k] for k in sorted(seen)]


def versions() -> dict:
    """Python, the key packages and torch's CUDA build, read without importing them (the
    ranks add NCCL's version from the torch they import: rank_versions)."""
    out = {"python": platform.python_version()}
    for name in KEY_PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    out["cuda"] = torch_cuda()
    return out


def torch_cuda() -> str | None:
    """The CUDA version torch was built for, read from its version.py without importing
    torch (the launch side does not import it); None for a CPU build or no torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return None
    try:
        text = (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        return None
    found = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
    return found.group(1) if found else None


def rank_versions() -> dict:
    """torch, CUDA and NCCL as a rank's imported torch reports them (NCCL only with CUDA)."""
    import torch  # local: torch (launch side)

    out = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        try:
            nccl = torch.cuda.nccl.version()
            out["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        except (RuntimeError, AttributeError):
            pass
    return out


def record(argv: list[str], node_rank: int, code: Path | None = None) -> tuple[dict, str, list[str]]:
    """(provenance.json's record, git.diff's text, requirements.txt's lines) of this launch."""
    git, diff = git_state()
    rec = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": shlex.join([Path(sys.executable).name, "-m", "launcher", *argv]),
        "argv": list(argv),
        "cwd": os.getcwd(),
        "host": socket.gethostname(),
        "node_rank": node_rank,
        "python_executable": sys.executable,
        "project": str(PROJECT),
        "code": str(code or PROJECT),
        "versions": versions(),
        "git": git,
    }
    return rec, diff, installed()


def write(run_dir: Path, argv: list[str], node_rank: int, code: Path | None = None) -> Path | None:
    """The record of this launch into RUN_DIR/provenance/<time>-node<k>/ (and, on node 0,
    RUN_DIR/provenance.json); returns its folder."""
    rec, diff, packages = record(argv, node_rank, code)
    try:
        return _write(run_dir, rec, diff, packages, node_rank)
    except OSError as e:  # a record, not a reason to refuse the launch
        print(f"note: no provenance record in {run_dir} ({e.strerror or e})", file=sys.stderr, flush=True)
        return None


def _write(run_dir: Path, rec: dict, diff: str, packages: list[str], node_rank: int) -> Path:
    folder = run_dir / FOLDER / f"{rec['time'].replace(':', '')}-node{node_rank}"
    n = 1
    while folder.exists():  # two launches within a second
        folder, n = folder.with_name(f"{rec['time'].replace(':', '')}-node{node_rank}-{n}"), n + 1
    folder.mkdir(parents=True)
    rec["folder"] = str(folder.relative_to(run_dir))
    (folder / "requirements.txt").write_text("\n".join(packages) + "\n")
    if diff:
        (folder / "git.diff").write_text(diff)
    text = json.dumps(rec, indent=1) + "\n"
    (folder / "provenance.json").write_text(text)
    if node_rank == 0:
        tmp = run_dir / f".{LATEST}.tmp"
        tmp.write_text(text)
        os.replace(tmp, run_dir / LATEST)
    return folder


def for_wandb(run_dir: Path) -> dict | None:
    """The latest record, short, for the W&B run's config: commit, dirty, command, host, versions, ranks' hosts."""
    try:
        rec = json.loads((run_dir / LATEST).read_text())
    except (OSError, ValueError):
        return None
    git = rec.get("git", {})
    out = {
        "command": rec.get("command"),
        "host": rec.get("host"),
        "code": rec.get("code"),
        "commit": git.get("commit"),
        "dirty": git.get("dirty"),
        "git_error": git.get("error"),
        "versions": rec.get("versions"),
        "record": rec.get("folder"),
    }
    last = last_start(run_dir)
    if last is not None:
        out["rank_hosts"], out["rank_versions"] = last.get("hosts"), last.get("versions")
        out["rank_code"], out["rank_git"] = last.get("code"), last.get("git")
    return {k: v for k, v in out.items() if v is not None}


def last_start(run_dir: Path) -> dict | None:
    """hosts.jsonl's latest whole line (a line cut short is skipped), or None."""
    try:
        lines = (run_dir / FOLDER / HOSTS).read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


def record_hosts(run_dir: Path, rank: int, world_size: int, group=None) -> None:
    """Every rank's host name, gathered once as the ranks start (one small collective on
    `group`, a CPU one); rank 0 appends them to RUN_DIR/provenance/hosts.jsonl with where
    this rank imported the project from (RUN_DIR/code for a Slurm job's snapshot)."""
    import torch.distributed as dist  # local: torch (launch side)

    hosts = [None] * world_size
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if rank != 0:
        return
    by_host: dict[str, list[int]] = {}
    for r, host in enumerate(hosts):
        by_host.setdefault(host, []).append(r)
    git, _ = git_state(with_diff=False)  # a start without the launcher (command.sh, a requeue) records it too
    line = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "world": world_size,
        "hosts": by_host,
        "code": str(PROJECT),
        "git": {k: v for k, v in git.items() if k != "untracked"},
        "python_executable": sys.executable,
        "versions": rank_versions(),
    }
    path = run_dir / FOLDER / HOSTS
    try:
        path.parent.mkdir(exist_ok=True)
        cut = path.exists() and path.stat().st_size and not path.read_bytes().endswith(b"\n")
        with open(path, "a") as f:  # a line cut short by a kill or a full disk stays apart from this one
            f.write(("\n" if cut else "") + json.dumps(line) + "\n")
    except OSError as e:  # provenance is a record, not a reason to stop
        print(f"note: the ranks' hosts were not recorded ({e.strerror or e})", flush=True)

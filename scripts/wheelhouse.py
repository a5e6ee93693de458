#!/usr/bin/env python
"""`make wheelhouse`: a folder of wheels for every dependency of the project but torch, for
compute nodes without network that bring their own (site-built, CUDA) torch.

    make wheelhouse WHEELHOUSE=/shared/wheels PYVER=3.12 PLATFORM=manylinux2014_x86_64
    make setup WHEELHOUSE=/shared/wheels TORCH=system      # on the node, no network

The versions are this environment's (`make setup`'s, the set the tests pass with): from the
project's requirements (with the extras asked for) every installed package they need is
followed through its own requirements, under the target Python's markers, except through
torch (torch and what only it needs, CUDA libraries, triton, sympy, stay with the node's
torch). Each is downloaded as a binary wheel for the target Python and platform; the packages
published only as source (DeepSpeed, antlr4's runtime) are built here into pure-Python wheels
(DeepSpeed with DS_BUILD_OPS=0: its ops compile on the node at first use, against the node's
torch and CUDA). The folder gets requirements.txt (name==version), which `make setup` installs.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parent.parent
# Published as source only: built here into pure-Python wheels (py3-none-any).
SOURCE_ONLY = ("deepspeed", "antlr4-python3-runtime")


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(req: str) -> str:
    return canon(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", req.strip()).group(0))


def project_requirements(extras: list[str]) -> list[str]:
    """The project's requirement strings (pyproject.toml): its dependencies, those of the
    chosen extras, and what builds it (setuptools, for the editable install on the node)."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    meta = pyproject["project"]
    reqs = list(meta["dependencies"]) + pyproject["build-system"]["requires"]  # setuptools builds the project there
    for extra in extras:
        if extra not in meta["optional-dependencies"]:
            sys.exit(f"wheelhouse: unknown extra {extra!r}; the project has {', '.join(meta['optional-dependencies'])}")
        reqs += meta["optional-dependencies"][extra]
    return reqs


def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"wheelhouse: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")


def needed_without_torch(reqs: list[str], python: str, stop: tuple[str, ...] = ("torch",)) -> dict[str, str]:
    """{name: installed version} of the packages the requirements need on that Python,
    followed through the installed packages' own requirements but never through torch
    (`stop`)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    env = {"python_version": python, "python_full_version": f"{python}.0", "extra": ""}
    seen: dict[str, str] = {}
    todo = [Requirement(r) for r in reqs]
    while todo:
        req = todo.pop()
        name = canon(req.name)
        if name in seen or name in stop or (req.marker and not req.marker.evaluate(env)):
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            sys.exit(
                f"wheelhouse: {req} is needed on Python {python} but not installed here; "
                "run make setup (or install it) first, so its version is the tested one"
            )
        seen[name] = dist.version
        for extra in sorted(req.extras):  # a requirement's own extras: their requirements too
            env_x = {**env, "extra": extra}
            todo += [r for r in map(Requirement, dist.requires or []) if r.marker and r.marker.evaluate(env_x)]
        todo += [r for r in map(Requirement, dist.requires or []) if not (r.marker and "extra" in str(r.marker))]
    return seen


def requirement_lines(needed: dict[str, str], python: str) -> list[str]:
    """requirements.txt: each package pinned to the tested version, except those the node's
    torch requires too (setuptools, typing-extensions, filelock, fsspec, markupsafe): the
    node's torch came with its own versions and may bound them (the H200's torch 2.11 did
    not take setuptools 84), so they are named without a version. pip keeps what the node
    has, and takes the folder's wheel only where the node has none."""
    torch_side = needed_without_torch(["torch"], python, stop=())
    return [f"{n}\n" if n in torch_side else f"{n}=={v}\n" for n, v in sorted(needed.items())]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "wheelhouse"))
    ap.add_argument(
        "--python",
        default=f"{sys.version_info.major}.{sys.version_info.minor}",
        help="the nodes' Python, e.g. 3.12 (default: this one)",
    )
    ap.add_argument(
        "--platform",
        default="manylinux2014_x86_64",
        help="the nodes' platform tag (manylinux2014_x86_64 also takes the newer manylinux wheels)",
    )
    ap.add_argument(
        "--extras", default="dev,hf,tb,fp8", help="the project's extras to include, comma-separated ('' for none)"
    )
    args = ap.parse_args()
    if not re.fullmatch(r"3\.\d{1,2}", args.python):
        sys.exit(f"wheelhouse: --python {args.python!r}: expected a version such as 3.12")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    reqs = project_requirements([e for e in args.extras.split(",") if e])
    target = ["--python-version", args.python, "--platform", args.platform, "--only-binary=:all:"]
    if args.platform.startswith("manylinux2014"):  # pip takes the newer manylinux tags only when named
        arch = args.platform.removeprefix("manylinux2014_")
        for glibc in ("2_28", "2_34"):
            target += ["--platform", f"manylinux_{glibc}_{arch}"]

    needed = needed_without_torch(reqs, args.python)
    source = [f"{n}=={needed[n]}" for n in SOURCE_ONLY if n in needed]
    print(f"wheelhouse: building {', '.join(source)} (published as source only)", flush=True)
    os.environ["DS_BUILD_OPS"] = "0"
    pip("wheel", "--quiet", "--no-deps", "--wheel-dir", str(out), *source)
    wanted = [f"{n}=={v}" for n, v in sorted(needed.items()) if n not in SOURCE_ONLY]
    print(
        f"wheelhouse: downloading {len(wanted)} wheels for Python {args.python} on {args.platform} "
        "(torch and what only it needs left out)",
        flush=True,
    )
    pip("download", "--quiet", "--no-deps", "--dest", str(out), *target, *wanted)
    (out / "requirements.txt").write_text("".join(requirement_lines(needed, args.python)))
    size = sum(f.stat().st_size for f in out.glob("*.whl"))
    print(
        f"wheelhouse: {len(needed)} packages, {size / 2**20:,.0f} MiB in {out}; on a node without network: "
        f"make setup WHEELHOUSE={out} TORCH=system"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

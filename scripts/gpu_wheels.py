#!/usr/bin/env python
"""The wheels to carry to a lent GPU machine (the device tool carries at most 64 MiB): a
`make wheelhouse` folder less what that machine already has or make gpu-check never imports,
into .gpu-wheels/ (git-ignored), with its requirements.txt cut to match.

    make wheelhouse WHEELHOUSE=/tmp/wheels PYVER=3.12 EXTRAS=dev,hf,fp8     # 87 packages, 164 MiB
    .venv/bin/python scripts/gpu_wheels.py /tmp/wheels                      # -> .gpu-wheels/: 51, 15 MiB

Left out: what the GPU machine's Python has beside its torch 2.11 (numpy, transformers,
accelerate, tokenizers, huggingface-hub, safetensors and their own), the data readers
(datasets, pyarrow, pandas: data=hf_text only; the check trains on synthetic data), W&B and
what only it needs (the check logs nothing: logger=none), matplotlib and its own (`make plan
--chart` only), and setuptools (the machine's torch bounds its version). `make setup
WHEELHOUSE=.gpu-wheels TORCH=system BUILD_OPS=0` then installs the rest with --no-index.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LIMIT = 64 * 2**20
LEAVE_OUT = (
    "numpy",
    "transformers",
    "accelerate",
    "tokenizers",
    "huggingface-hub",
    "hf-xet",
    "safetensors",
    "regex",
    "datasets",
    "pyarrow",
    "pandas",
    "multiprocess",
    "dill",
    "xxhash",
    "tzdata",
    "wandb",
    "cwevals",
    "protobuf",
    "googleapis-common-protos",
    "opentelemetry-*",
    "matplotlib",
    "pillow",
    "fonttools",
    "kiwisolver",
    "contourpy",
    "cycler",
    "pyparsing",
    "python-dateutil",
    "setuptools",
)


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def left_out(name: str) -> bool:
    name = canon(name)
    return any(name == p or (p.endswith("*") and name.startswith(p[:-1])) for p in LEAVE_OUT)


def main() -> int:
    if len(sys.argv) != 2 or not (Path(sys.argv[1]) / "requirements.txt").is_file():
        sys.exit("usage: gpu_wheels.py <a make wheelhouse folder, with its requirements.txt>")
    src, out = Path(sys.argv[1]), REPO / ".gpu-wheels"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    wheels = [w for w in sorted(src.glob("*.whl")) if not left_out(w.name.split("-")[0])]
    for w in wheels:
        shutil.copy2(w, out / w.name)
    lines = [
        line
        for line in (src / "requirements.txt").read_text().splitlines()
        if line.strip() and not left_out(re.split(r"[=<>! ]", line.strip())[0])
    ]
    (out / "requirements.txt").write_text("\n".join(lines) + "\n")
    size = sum(w.stat().st_size for w in wheels)
    print(
        f"gpu_wheels: {len(wheels)} wheels, {size / 2**20:.0f} MiB in {out}: "
        + ", ".join(w.name.split("-")[0] for w in wheels)
    )
    if size > LIMIT:
        print(f"gpu_wheels: over the device tool's {LIMIT // 2**20} MiB: leave out more (LEAVE_OUT)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

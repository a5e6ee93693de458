"""Compile DeepSpeed's just-in-time ops now (`make setup BUILD_OPS=1`, `make test`'s set-up):
CPU Adam (zero*_offload's optimizer step) and, on a host without a GPU, the shared-memory
communication op every DeepSpeed rank loads when it joins its process group. Without this a
run that needs one compiles it on the launch side before its ranks start, once per
environment (launcher/ops.py).

    .venv/bin/python scripts/build_ops.py

Nothing here is needed to train: an op that cannot be built (no compiler, no CUDA toolkit for
a CUDA build) is said in one line. Exit status 0 either way.
"""

from __future__ import annotations

import sys

from launcher import ops


def main() -> int:
    ops.build(ops.ALL, quiet_when_built=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())

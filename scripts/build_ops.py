"""Compile DeepSpeed's just-in-time ops once, at `make setup`, instead of in the first ranks
that need them: CPU Adam (zero*_offload's optimizer step) and, on a host without a GPU,
the shared-memory communication op that every DeepSpeed rank loads when it joins its
process group. torch caches them in launcher.host.ops_cache_dir() (TORCH_EXTENSIONS_DIR), where
every later rank finds them in about a second; compiled in a rank they cost 20-40 s each
on a 2-core machine, paid by whichever run comes first and, with several ranks starting at
once, waited for behind one lock.

    .venv/bin/python scripts/build_ops.py

Nothing here is needed to train: an op that cannot be built (no compiler, no CUDA
toolkit for a CUDA build) is said in one line, and the first rank that needs it compiles
it or fails with DeepSpeed's own message. Exit status 0 either way.
"""

from __future__ import annotations

import sys
import time

from launcher.host import deepspeed_env

OPS = ("CPUAdamBuilder", "ShareMemCommBuilder")


def main() -> int:
    deepspeed_env()  # the accelerator a rank tells DeepSpeed: the ops are built for it
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError as err:
        print(f"build_ops: DeepSpeed is not installed ({err}); nothing to build", file=sys.stderr)
        return 0
    accelerator = get_accelerator()
    for name in OPS:
        builder = accelerator.create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            continue
        started = time.perf_counter()
        try:
            builder.load(verbose=False)
        except Exception as err:  # a missing compiler: the first rank that needs the op will say it too
            print(f"build_ops: {builder.NAME} not built ({type(err).__name__}: {str(err).splitlines()[0][:200]})",
                  file=sys.stderr)
            continue
        print(f"build_ops: {builder.NAME} ready ({time.perf_counter() - started:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

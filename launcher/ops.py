"""DeepSpeed's just-in-time ops, compiled once per Python environment when a run first needs
one (the launch side, before any rank starts, with a line that says so) or by `make setup
BUILD_OPS=1` / scripts/build_ops.py when asked, not by every set-up: compiling them took 4.6
of set-up's 7 minutes on 2 cores (cpu_adam 174 s, the shared-memory op 102 s), for the
default ddp run that never loads one (issue 48). Compiled inside the ranks instead, each
would wait behind one lock and a 2-step zero2 run took 43.6 s instead of 10.3 s.

torch keeps them in launcher.host.ops_cache_dir() (TORCH_EXTENSIONS_DIR, one folder per
environment), where every later rank loads them in about a second. Imported by the launch
side only when a DeepSpeed recipe launches, and by scripts/build_ops.py.
"""

from __future__ import annotations

import os
import sys
import time

import engines
from launcher import config as C
from launcher.host import deepspeed_env

CPU_ADAM, SHM_COMM = "CPUAdamBuilder", "ShareMemCommBuilder"
ALL = (CPU_ADAM, SHM_COMM)


def needed(cfg: C.Config, cuda: bool) -> list[str]:
    """The ops a run of this config loads: CPU Adam where the optimizer steps on the host
    (recipe.zero.offload_optimizer), DeepSpeed's shared-memory collectives on a CPU."""
    if not engines.spec(cfg.recipe.engine).deepspeed:
        return []
    offload = cfg.recipe.zero.offload_optimizer != C.OffloadDevice.none
    return [name for name, use in ((CPU_ADAM, offload), (SHM_COMM, not cuda)) if use]


STALE_LOCK_S = 600.0
"""A build lock this old with no build running is left over: a build takes 1-3 minutes on 2
cores, and a live one keeps its compiler running in the folder."""


def build_folder(name: str) -> str:
    from torch.utils.cpp_extension import _get_build_directory  # local: torch (launch side)

    return _get_build_directory(name, verbose=False)


def clear_stale_lock(folder: str, min_age_s: float = STALE_LOCK_S) -> bool:
    """Remove `folder`/lock when an interrupted build left it: torch takes that file for every
    load of the op, built or not (cpp_extension._jit_compile's FileBaton), and waits for it
    without end or message, so one killed build hung every later DeepSpeed run of the host.
    Stale: older than `min_age_s` and no process working in the folder (torch runs ninja
    there, and ninja the compiler). Says so in one line; True when it removed one."""
    lock = os.path.join(folder, "lock")
    try:
        age = time.time() - os.stat(lock).st_mtime
    except FileNotFoundError:
        return False
    if age < min_age_s or working_in(folder):
        return False
    try:
        os.remove(lock)
    except FileNotFoundError:  # another launch removed it first
        return False
    print(
        f"DeepSpeed ops: removed {lock}, a build lock left by an interrupted build "
        f"({age / 3600:.1f} h old, no build running); torch would wait for it without end",
        file=sys.stderr,
        flush=True,
    )
    return True


def working_in(folder: str) -> bool:
    """Whether a process of this host has its working directory at or under `folder`."""
    real = os.path.realpath(folder)
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if pid.isdigit():
            try:
                cwd = os.readlink(f"/proc/{pid}/cwd")
            except OSError:  # gone, or another user's
                continue
            if cwd == real or cwd.startswith(real + os.sep):
                return True
    return False


def built(builder) -> bool:
    """Whether torch's cache holds the op's library (a changed build command still rebuilds
    it, in torch's own load)."""
    return os.path.isfile(os.path.join(build_folder(builder.name), f"{builder.name}.so"))


def build(names: list[str] | tuple[str, ...], quiet_when_built: bool = True) -> None:
    """Compile the named ops that are not built yet, one line before and after each (on
    stderr). An op that cannot be built (no compiler, no CUDA toolkit) is said in one line and
    left to the rank that needs it, which fails with DeepSpeed's own message: nothing here
    ends a run."""
    if not names:
        return
    deepspeed_env()  # the accelerator and the cache folder a rank will use
    try:
        # local: order (deepspeed_env() first: DeepSpeed reads DS_ACCELERATOR when imported)
        from deepspeed.accelerator import get_accelerator
    except ImportError as err:
        print(f"DeepSpeed ops: DeepSpeed is not installed ({err}); nothing to build", file=sys.stderr, flush=True)
        return
    accelerator = get_accelerator()
    for name in names:
        builder = accelerator.create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            continue
        clear_stale_lock(build_folder(builder.name))
        if built(builder) and quiet_when_built:
            continue
        print(
            f"DeepSpeed ops: compiling {builder.NAME} for this environment (once; 1-3 minutes on 2 cores, "
            f"into {os.environ['TORCH_EXTENSIONS_DIR']})",
            file=sys.stderr,
            flush=True,
        )
        started = time.perf_counter()
        try:
            builder.load(verbose=False)
        except Exception as err:  # noqa: BLE001 -- a missing compiler: the rank that needs the op says it too
            print(
                f"DeepSpeed ops: {builder.NAME} not built ({type(err).__name__}: {str(err).splitlines()[0][:200]})",
                file=sys.stderr,
                flush=True,
            )
            continue
        print(
            f"DeepSpeed ops: {builder.NAME} ready ({time.perf_counter() - started:.1f} s)", file=sys.stderr, flush=True
        )

"""The one device layer: everything that differs between CUDA and CPU lives here.

What the machine has (GPUs, their names and memory) is launcher/host.py's, asked without
torch by the launch side. The rank side gets its device, backend, autocast dtype and memory readings
from here, so the rest of the code runs unchanged on a CPU-only machine with gloo.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

from launcher.host import current_rss, table_tflops



def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def local_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def autocast_dtype(precision: str) -> torch.dtype | None:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[precision]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_values(device: torch.device, *values) -> list[float]:
    """The step's scalars (loss, gradient norm, loss scale, skipped steps) as Python floats,
    with one device-to-host copy for all the tensors among them: one host synchronisation
    per logged step, where reading each (`.item()`, `float()`) waits for the device once
    per value. Python numbers pass through."""
    tensors = [v.full_tensor() if hasattr(v, "full_tensor") else v for v in values if isinstance(v, torch.Tensor)]
    stacked = torch.stack([t.detach().reshape(()).to(device, torch.float64) for t in tensors]) if tensors else None
    read = iter(stacked.tolist() if stacked is not None else ())
    return [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]


# ----------------------------------------------------------------------------- memory
def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def memory_stats(device: torch.device) -> dict[str, int]:
    """mem/peak_bytes: CUDA max allocated, or the process's peak RSS on CPU.
    mem/reserved_bytes: CUDA reserved by the caching allocator, or current RSS on CPU
    (what the process holds from the OS now)."""
    if device.type == "cuda":
        return {
            "mem/peak_bytes": torch.cuda.max_memory_allocated(device),
            "mem/reserved_bytes": torch.cuda.memory_reserved(device),
        }
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"mem/peak_bytes": peak_kib * 1024, "mem/reserved_bytes": current_rss()}


def startup_peaks(device: torch.device, started: float, base: int, built: int | None) -> dict:
    """The start-up figures of this rank, taken once its engine is ready (before step 1):
    host_peak_bytes, the process's peak RSS so far; host_base_bytes (`base`), its RSS just
    before the model was built (interpreter, torch, the recipe's imports, the process
    group), so that host_peak - host_base is what building the model and engine cost the
    host; host_built_peak_bytes (`built`), the peak RSS when this rank's part of the model
    was built (launcher.models.init.BUILT_PEAK_RSS), before the recipe's engine added its own state (DeepSpeed's optimizer set-up); device_peak_bytes, CUDA max_memory_allocated so far (None on CPU); seconds from
    the process's start (`started`, a time.time() value) to now."""
    return {"host_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "host_base_bytes": base,
            "host_built_peak_bytes": built,
            "device_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            "seconds": round(time.time() - started, 3)}


@contextlib.contextmanager
def returned_to_the_os():
    """Start-up on glibc: blocks of 1 MiB and more are mmap'ed, so what building the model
    and engine allocates and frees (DeepSpeed flattening and converting its partitions,
    its optimizer set-up; the init blocks) goes back to the OS when freed, rather than
    staying in glibc's heap, resident, for the whole run. Measured on CPU (gpt_125m, 2
    ranks, zero3 fp32): start-up peak 10.3 -> 9.0 bytes per parameter, held after it 8.5 ->
    6.5. Afterwards the threshold is glibc's own largest (32 MiB), where its dynamic
    threshold would settle, and the trim threshold twice that, as glibc's dynamic rule sets
    it: steps reuse the heap as before. Setting one threshold turns glibc's dynamic
    adjustment off for both, so the trim threshold would stay at its 128 KiB: every step's
    freed activations went back to the OS and were faulted in again in the next step (10%
    more page faults than a hand-written loop on CPU, llama_5m). A no-op elsewhere, and
    when the user set MALLOC_MMAP_THRESHOLD_ (their choice stands; MALLOC_TRIM_THRESHOLD_
    likewise)."""
    libc = None
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        yield
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):
        libc = None
    try:
        yield
    finally:
        if libc is not None:
            libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
            if "MALLOC_TRIM_THRESHOLD_" not in os.environ:
                libc.mallopt(_M_TRIM_THRESHOLD, 64 << 20)
            libc.malloc_trim(0)


_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD = -3, -1  # glibc malloc.h


# ----------------------------------------------------------------------------- profiler
def profiler_activities(device: torch.device) -> list:
    """What torch.profiler records: CPU operators always, CUDA kernels on a GPU."""
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


def record_memory_history(device: torch.device) -> bool:
    """Start recording every CUDA allocation with its stack (the allocator's own history);
    False on CPU, where there is no caching allocator to record."""
    if device.type != "cuda":
        return False
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    return True


def dump_memory_snapshot(device: torch.device, path: Path) -> None:
    """Write the recorded history (pytorch.org/memory_viz opens it) and stop recording."""
    if device.type == "cuda":
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)


# ----------------------------------------------------------------------------- peak FLOPs
def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "launcher"


def use_tf32(device: torch.device, enabled: bool) -> None:
    """precision.tf32: fp32 matmuls and convolutions on CUDA's tensor cores in TF32. The
    CUDA switches only: torch.set_float32_matmul_precision would change CPU (oneDNN) matmuls too."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled


def peak_flops(device: torch.device, dtype: torch.dtype | None, tflops: float | None = None) -> tuple[float, str | None]:
    """Peak FLOP/s of one device for MFU, and a warning when it is a guess. On GPUs:
    `tflops` (cluster.peak_tflops), else the device table by name, else the measured matmul
    rate (warned); halved in fp32 with TF32 (half the bf16 rate), measured in IEEE fp32
    (no tensor cores). On CPU: measured once and cached."""
    if device.type == "cuda":
        if dtype is None and not torch.backends.cuda.matmul.allow_tf32:
            return measure_matmul_flops(device, torch.float32), None
        name = torch.cuda.get_device_name(device)
        known = tflops or table_tflops(name)
        if known is not None:
            return known * 1e12 * (1.0 if dtype is not None else 0.5), None
        measured = measure_matmul_flops(device, dtype or torch.float32)
        return measured, (f"warning: no peak FLOP/s known for the GPU {name!r}: MFU divides by its measured matmul "
                          f"rate ({measured / 1e12:.0f} TFLOP/s), which overstates MFU; set cluster.peak_tflops")
    dtype = dtype or torch.float32
    key = f"{_cpu_model()}|threads={torch.get_num_threads()}|{dtype}"
    path = _cache_dir() / "cpu_peak_flops.json"
    cache = {}
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    if key not in cache:
        cache[key] = measure_matmul_flops(device, dtype)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass
    return float(cache[key]), None


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, n: int = 1024, seconds: float = 0.3) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    synchronize(device)
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        synchronize(device)
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t0))
    return best


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return sys.platform

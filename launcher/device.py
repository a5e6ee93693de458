"""The one device layer: everything that differs between CUDA and CPU lives here.

What the machine has (GPUs, their names and memory) is launcher/host.py's, asked without
torch by the launch side. The rank side gets its device, backend, autocast dtype and memory readings
from here, so the rest of the code runs unchanged on a CPU-only machine with gloo.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity

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
    return {
        "host_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "host_base_bytes": base,
        "host_built_peak_bytes": built,
        "device_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "seconds": round(time.time() - started, 3),
    }


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
def use_tf32(device: torch.device, enabled: bool) -> None:
    """precision.tf32: fp32 matmuls and convolutions on CUDA's tensor cores in TF32. The
    CUDA switches only: torch.set_float32_matmul_precision would change CPU (oneDNN) matmuls too."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled


def peak_flops(
    device: torch.device, dtype: torch.dtype | None, tflops: float | None = None
) -> tuple[float | None, str | None]:
    """Peak FLOP/s of one device for MFU, or None where the launcher knows none, and the line
    that says so. `tflops` (cluster.peak_tflops) first; else a GPU's data-sheet figure by its
    name (launcher/host.py; fp32 with TF32 is half the bf16 rate; IEEE fp32 has no entry).
    A CPU has no known peak: a matmul measured in bf16 on a CPU without native bf16 gave an
    MFU of 500-1007% (issue 48), so no MFU is reported there unless cluster.peak_tflops says."""
    if tflops:
        return tflops * 1e12, None
    if device.type != "cuda":
        return None, None
    name = torch.cuda.get_device_name(device)
    known = table_tflops(name)
    if known is None:
        return None, f"MFU not reported: no peak FLOP/s known for the GPU {name!r}; set cluster.peak_tflops"
    if dtype is None and not torch.backends.cuda.matmul.allow_tf32:
        return (
            None,
            "MFU not reported: IEEE fp32 (precision.tf32=false) has no peak in the device table; set cluster.peak_tflops",
        )
    return known * 1e12 * (1.0 if dtype is not None else 0.5), None

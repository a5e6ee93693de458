"""What this machine has, asked without torch or a CUDA context: read by the launch side
(validation, `make plan`, the command's process count) and by the ranks' device layer
(launcher/device.py). torch is imported only by `HostInfo.detect` (on a host whose GPUs
only CUDA can count: ROCm, WSL, CUDA_VISIBLE_DEVICES by UUID) and `deepspeed_env`, when
called."""

from __future__ import annotations

import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

# Dense (no 2:4 sparsity) bf16 tensor-core peak of one device in TFLOP/s, from the vendors'
# data sheets; fp16 for parts without bf16 (V100, T4). Matched against the device's name
# (torch.cuda.get_device_name / nvidia-smi: "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB",
# "Tesla V100-SXM2-32GB", "AMD Instinct MI300X") by whole words, first match wins: the
# variants (NVL, PCIe) before their family, so an L40S is never an L4 nor an H100 NVL an SXM.
GPU_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"GB200", 2500.0),
    (r"B200", 2250.0),
    (r"B100", 1750.0),
    (r"H200 NVL|H200.*PCIE", 835.0),
    (r"H200|GH200", 989.0),
    (r"H100 NVL", 835.0),
    (r"H100.*PCIE", 756.0),
    (r"H100", 989.0),  # SXM ("H100 80GB HBM3") and the SXM name without its memory
    (r"H800.*PCIE", 756.0),
    (r"H800", 989.0),
    (r"H20", 148.0),
    (r"A100|A800", 312.0),  # SXM and PCIe, 40 and 80 GB alike
    (r"A30", 165.0),
    (r"A40", 149.7),
    (r"A10G", 70.0),  # AWS's A10 variant: fewer tensor FLOP/s than the A10
    (r"A10", 125.0),
    (r"L40S", 362.0),
    (r"L40", 181.0),
    (r"L4", 121.0),
    (r"V100.*PCIE", 112.0),  # fp16: Volta has no bf16
    (r"V100", 125.0),
    (r"T4", 65.0),  # fp16
    (r"MI355X?", 2500.0),
    (r"MI325X?", 1307.0),
    (r"MI300X", 1307.0),
    (r"MI300A", 980.6),
    (r"MI250X", 383.0),
    (r"MI250", 362.0),
)


@dataclass(frozen=True)
class HostInfo:
    cuda: bool
    gpus: int
    cpus: int

    @property
    def slots(self) -> int:
        """Processes one node may run: one per GPU, or up to 4 per core on CPU."""
        return self.gpus if self.cuda else 4 * self.cpus

    @staticmethod
    def detect() -> "HostInfo":
        cpus = usable_cores()
        if not gpu_driver():  # torch could see no GPU either: a second of importing it saved
            return HostInfo(cuda=False, gpus=0, cpus=cpus)
        gpus = visible_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"), nvidia_gpus())
        if gpus is None:  # only CUDA can tell (ROCm, WSL, devices named by UUID): ask torch
            import torch  # local: torch (launch side); counting GPUs creates no CUDA context

            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return HostInfo(cuda=gpus > 0, gpus=gpus, cpus=cpus)


def usable_cores() -> int:
    """The cores this process may use (its CPU affinity: a Slurm step's, a container's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def gpu_driver() -> bool:
    """Whether a GPU driver shows on this host (NVIDIA's device files or /proc entry, ROCm's
    /dev/kfd, WSL's /dev/dxg). Without one, torch.cuda finds no device."""
    return bool(
        glob.glob("/dev/nvidia[0-9]*")
        or glob.glob("/proc/driver/nvidia/gpus/*")
        or any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg"))
    )


def nvidia_gpus() -> int | None:
    """NVIDIA GPUs this process can reach: the fewer of the driver's (/proc/driver/nvidia/gpus/,
    one folder each) and the device files (/dev/nvidia0, 1, ...: a container gets only its
    own), or None where neither shows one (ROCm, WSL, no NVIDIA driver)."""
    counts = [n for n in (len(glob.glob("/proc/driver/nvidia/gpus/*")), len(glob.glob("/dev/nvidia[0-9]*"))) if n]
    return min(counts) if counts else None


def visible_gpus(cuda_visible_devices: str | None, installed: int | None) -> int | None:
    """The GPUs CUDA will show this process, counted as torch.cuda.device_count() counts
    them, without importing torch (on a CUDA host, seconds of every launch): all
    `installed` ones, or the CUDA_VISIBLE_DEVICES ordinals up to the first that is not a
    valid, new ordinal (CUDA ignores the rest). None where only CUDA can tell: the driver's
    count unknown, or devices named by UUID (GPU-..., MIG-...)."""
    if installed is None:
        return None
    if cuda_visible_devices is None:
        return installed
    seen: list[int] = []
    for item in cuda_visible_devices.split(","):
        item = item.strip()
        if item.startswith(("GPU-", "MIG-")):
            return None
        if not item.isdigit() or int(item) >= installed or int(item) in seen:
            break
        seen.append(int(item))
    return len(seen)


def _nvidia_smi(field: str) -> str | None:
    """One field of GPU 0 from nvidia-smi: no CUDA context is created on the launch side."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
        return out.splitlines()[0].strip() or None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


# NVIDIA parts with float8 tensor cores (Hopper, Ada, Blackwell: compute capability 8.9+),
# matched like GPU_PEAK_TFLOPS; other names known to that table (A100, V100, ...) have none.
FP8_GPUS = r"GB200|B200|B100|H200 NVL|H200|GH200|H100 NVL|H100|H800|H20|L40S|L40|L4|RTX 40\d\d|RTX 6000 ADA"


def fp8_capable(name: str | None) -> bool | None:
    """Whether a GPU (by name) has float8 tensor cores; None for a name neither table knows."""
    if not name:
        return None
    words = re.sub(r"[^A-Z0-9]+", " ", name.upper())
    if re.search(rf"\b(?:{FP8_GPUS})\b", words):
        return True
    return False if table_tflops(name) is not None else None


def gpu_memory_bytes() -> int | None:
    """Memory of GPU 0, or None without a GPU."""
    value = _nvidia_smi("memory.total")
    return int(value) * 2**20 if value and value.isdigit() else None


def gpu_name() -> str | None:
    return _nvidia_smi("name")


def table_tflops(name: str | None) -> float | None:
    """Dense bf16 TFLOP/s of a GPU by its name (GPU_PEAK_TFLOPS), None for one not in the table."""
    if not name:
        return None
    words = re.sub(r"[^A-Z0-9]+", " ", name.upper())  # "A100-SXM4-80GB" -> "A100 SXM4 80GB"
    for pattern, tflops in GPU_PEAK_TFLOPS:
        if re.search(rf"\b(?:{pattern})\b", words):
            return tflops
    return None


def native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes bf16 natively (x86: AVX-512 BF16 or AMX; Arm: the bf16
    feature), from /proc/cpuinfo's flags (or `cpuinfo`, its text). Without it torch emulates
    bf16 matmuls on the CPU: a step of the tiny model took 8-14x as long as in fp32 (1,052-1,235
    against 15,031 tokens/s, issue 48). False where the flags cannot be read."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features") and {"avx512_bf16", "amx_bf16", "bf16"} & set(value.split()):
            return True
    return False


def process_start_time() -> float:
    """When this process started (time.time() scale): the kernel's record, so imports count."""
    try:
        import psutil  # local: start-up (psutil, 0.09 s)

        return psutil.Process().create_time()
    except Exception:  # noqa: BLE001 -- no /proc: count from the first call instead
        return time.time()


def current_rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


# ----------------------------------------------------------------------------- DeepSpeed
def deepspeed_env() -> None:
    """Tell DeepSpeed its accelerator before it is imported: it would otherwise probe for one
    and print a warning on a CPU-only machine (on stdout, into every launch's output). And
    where its just-in-time ops are cached: one folder per Python environment
    (`ops_cache_dir`), unless TORCH_EXTENSIONS_DIR says otherwise."""
    import torch  # local: torch (launch side)

    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", ops_cache_dir())


def ops_cache_dir() -> str:
    """torch's cache of compiled ops (~/.cache/torch_extensions), one folder per Python
    environment: torch keys an op's folder by its name and rebuilds it whenever the build
    command changes, and the command names the environment's include paths. Two virtual
    environments on one host (two checkouts, a CI clone beside a work tree) sharing one
    folder rebuild each other's ops (20-40 s each on 2 cores), inside the first rank that
    loads one."""

    import torch._appdirs  # local: torch (launch side)

    root = os.path.realpath(torch._appdirs.user_cache_dir(appname="torch_extensions"))
    env = os.path.realpath(sys.prefix)
    name = os.path.basename(env).lstrip(".") or "python"  # .venv: not a hidden folder
    return os.path.join(root, f"{name}-{hashlib.sha256(env.encode()).hexdigest()[:10]}")

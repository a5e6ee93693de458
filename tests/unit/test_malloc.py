"""launcher.device.returned_to_the_os: start-up's freed blocks go back to the OS, and the
steps after it keep reusing glibc's heap as a process that never touched malloc's settings
does (a freed block below the thresholds stays resident for the next step, no page faults
to take it back). In a fresh interpreter: malloc's settings are per process."""

import os
import subprocess
import sys

from runs import REPO

PROBE = r"""
import ctypes, os
from launcher.device import returned_to_the_os

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
with returned_to_the_os():
    pass
size = 16 << 20  # below the 32 MiB mmap threshold: from the heap, as a step's activations
block = libc.malloc(size)
ctypes.memset(block, 1, size)
held = rss()
libc.free(block)
print((held - rss()) >> 20)
"""


def test_after_start_up_a_freed_block_stays_in_the_heap_for_the_next_step():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    returned_mib = int(proc.stdout.split()[-1])
    assert returned_mib <= 2, f"{returned_mib} of 16 MiB went back to the OS on free (glibc's 128 KiB trim threshold)"

"""How the probe process hands memory back: freed buffers up to `KEPT_BYTES` stay in the C heap for the next forward.

glibc returns any buffer over its mmap threshold (at most 32 MiB) to the kernel when it is freed, and the next
forward faults the same amount in again, page by page. A forward at 1024 tokens frees hundreds of MB of such buffers
(SmolLM2's logits alone are 200 MB), so the default `probe kv-heads` (about 100 forwards) spent 40 s of system
time in 20 million page faults; with the buffers kept it spent 1.4 s, and its wall time went from 3:49 to 3:20, for a
peak RSS of 1.59 instead of 1.33 GiB (bench/NOTES.md). Buffers larger than `KEPT_BYTES` (32k-token attention
temporaries) are still returned, so a long run's peak is not held after it.
"""

from __future__ import annotations

import ctypes
import platform

KEPT_BYTES = 256 * 2**20  # buffers up to this size come from the heap, not from mmap
TRIM_BYTES = 2**30  # free heap beyond this is returned to the kernel
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def keep_freed_buffers() -> bool:
    """Set glibc's thresholds for this process; False where the C library is not glibc (nothing changes)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, KEPT_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES))

"""Freed buffers up to `KEPT_BYTES` stay in the C heap for the next forward: glibc returned them to the kernel, and
the default `probe kv-heads` spent 40 s in page faults faulting them back, 1.4 s with them kept (bench/NOTES.md)."""

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

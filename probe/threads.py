"""torch's threads: the free CPUs unless given (`--threads N`, PROBE_THREADS). On cores shared with other work,
torch's default of one thread per core makes every thread wait for the others."""

from __future__ import annotations

import os

import torch

from probe.errors import ProbeError

ENV = "PROBE_THREADS"


def free_cpus() -> int:
    """The CPUs this process may run on less the machine's 1-minute load average, at least one."""
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this platform
        load = 0.0
    return min(allowed, max(1, allowed - round(load)))


def use_threads(count: int | None = None) -> int:
    """Set torch's thread count to `count`, else to PROBE_THREADS, else to `free_cpus()`; the count set."""
    if count is None and os.environ.get(ENV, "").strip():
        text = os.environ[ENV].strip()
        if not text.isdigit() or int(text) < 1:
            raise ProbeError(f"{ENV}={text!r}: give a whole number of threads, at least 1")
        count = int(text)
    chosen = free_cpus() if count is None else count
    torch.set_num_threads(chosen)
    return chosen

"""torch's threads: the free CPUs unless given (`--threads N`, PROBE_THREADS). On cores shared with other work,
torch's default of one thread per core makes every thread wait for the others."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from probe.errors import ProbeError

ENV = "PROBE_THREADS"
PROC_STAT = Path("/proc/stat")
SAMPLE_SECONDS = 0.25  # long enough for the kernel's 100 Hz tick to count a busy CPU, short beside a model's load
TORCH_DEFAULT = torch.get_num_threads()  # torch's own count, as it was when probe was imported
_chosen: list[int] = []  # the count use_threads set in this process, once it has


def free_cpus() -> int:
    """The CPUs this process may run on less those other processes keep busy now, at least one: sampled from
    /proc/stat where there is one (the 1-minute load average lags: a command started right after another would see
    the first one's load), else the load average."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    busy = sampled_busy(allowed)
    if busy is None:
        try:
            busy = os.getloadavg()[0]
        except (AttributeError, OSError):  # no load average on this platform
            busy = 0.0
    return min(len(allowed), max(1, len(allowed) - round(busy)))


def sampled_busy(cpus: set[int], seconds: float = SAMPLE_SECONDS) -> float | None:
    """The busy share of each of `cpus` over `seconds`, summed (this process sleeps meanwhile); None without
    /proc/stat."""
    try:
        before = cpu_ticks(PROC_STAT.read_text(), cpus)
        time.sleep(seconds)
        after = cpu_ticks(PROC_STAT.read_text(), cpus)
    except OSError:
        return None
    busy = 0.0
    for cpu in after.keys() & before.keys():
        spent = after[cpu][1] - before[cpu][1]
        busy += 0.0 if spent <= 0 else 1 - (after[cpu][0] - before[cpu][0]) / spent
    return busy


def cpu_ticks(stat: str, cpus: set[int]) -> dict[int, tuple[int, int]]:
    """(idle ticks, all ticks) of each of `cpus` from the text of /proc/stat (idle counts waiting for input too)."""
    ticks = {}
    for line in stat.splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            values = [int(value) for value in fields[:8]]  # user nice system idle iowait irq softirq steal
            ticks[int(name[3:])] = (values[3] + values[4], sum(values))
    return ticks


def use_threads(count: int | None = None) -> int:
    """Set torch's thread count to `count`, else to PROBE_THREADS, else to `free_cpus()`; the count set."""
    if count is None and os.environ.get(ENV, "").strip():
        text = os.environ[ENV].strip()
        if not text.isdigit() or int(text) < 1:
            raise ProbeError(f"{ENV}={text!r}: give a whole number of threads, at least 1")
        count = int(text)
    chosen = free_cpus() if count is None else count
    torch.set_num_threads(chosen)
    _chosen[:] = [chosen]
    return chosen


def use_threads_unless_chosen() -> int | None:
    """use_threads() for the Python API, unless a count was chosen already: by use_threads (the CLI), by
    OMP_NUM_THREADS, or by torch.set_num_threads to a count other than torch's default. The count set, or None."""
    if _chosen or os.environ.get("OMP_NUM_THREADS", "").strip() or torch.get_num_threads() != TORCH_DEFAULT:
        return None
    return use_threads()

"""The CLI keeps freed buffers in the C heap (probe.cli.allocator): a buffer freed and allocated again is not faulted
in again page by page, which is what the default `probe kv-heads` spent 40 s of system time on."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest


REALLOCATE = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from probe.cli.allocator import keep_freed_buffers
    assert keep_freed_buffers()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
counts = []
for _ in range(8):
    before = faults()
    torch.empty(100 * 2**20 // 4).fill_(1.0)  # 100 MB, freed at once: over glibc's own mmap threshold
    counts.append(faults() - before)
print(sum(counts[3:]))
"""


def _late_faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", REALLOCATE, mode], capture_output=True, text=True, check=True,
                          env={"OMP_NUM_THREADS": "1", "PATH": ""})
    return int(done.stdout.split()[-1])


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's")
def test_a_freed_buffer_is_reused_without_page_faults_once_kept() -> None:
    pages = 100 * 2**20 // 4096
    assert _late_faults("default") >= 4 * pages  # glibc alone: every allocation faults its pages in again
    assert _late_faults("keep") < pages // 10


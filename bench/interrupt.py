"""Benchmark: how long the README's test command takes to stop after Ctrl-C.

A terminal's Ctrl-C sends SIGINT to the whole foreground process group: pytest and any child it started. This starts
the suite in a process group of its own, sends SIGINT to the group at several moments of the run, and measures the
seconds until pytest has exited (and which test file was running when the signal came).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench.common import ROOT, load_average, machine, now, save_result

OFFSETS = (20, 50, 80, 110)  # seconds into the run at which Ctrl-C comes: before its end (2:20 quiet, fastest host)
STOP_LIMIT = 120  # seconds a Ctrl-C is given before the run counts as not stopped
COMMAND = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", "not slow"]


def one(offset: float) -> dict[str, Any]:
    with tempfile.TemporaryFile("w+") as log:  # a file, not a pipe: a full pipe would stall the run
        child = subprocess.Popen(COMMAND, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                                 start_new_session=True)
        time.sleep(offset)
        sent = time.perf_counter()
        os.killpg(child.pid, signal.SIGINT)
        try:
            code, stopped = child.wait(timeout=STOP_LIMIT), time.perf_counter() - sent
        except subprocess.TimeoutExpired:  # the Ctrl-C was swallowed: recorded so, and the run killed
            os.killpg(child.pid, signal.SIGKILL)
            code, stopped = child.wait(), None
        log.seek(0)
        running = re.findall(r"^(tests/\S+?) ", log.read(), re.M)
    return {"offset_s": offset, "stop_s": stopped, "exit_code": code, "last_test": running[-1] if running else ""}


def main() -> None:
    before = load_average()
    rows = []
    for offset in OFFSETS:
        rows.append(one(offset))
        print(rows[-1], file=sys.stderr)
    save_result("interrupt", {"date": now(), "command": "python -m bench.interrupt",
                              "machine": machine(packages=()), "load_before": before, "load_after": load_average(),
                              "test_command": shlex.join(["python", *COMMAND[1:]]), "rows": rows})
    from bench import report

    report.write()


if __name__ == "__main__":
    main()

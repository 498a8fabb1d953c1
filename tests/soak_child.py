"""The soak's children (tests/test_soak.py): each run of `probe ARGS` a process forked from a multiprocessing fork
server, never from the test process.

The server is started once per test session, with OMP_NUM_THREADS=1 in its environment, and imports torch,
transformers and probe's CLI before it forks anything (`set_forkserver_preload`): a child starts with the imports done,
so a run costs its own work, not Python's start (a few seconds each, most of the soak otherwise). The server itself
runs no torch op, so no thread pool of torch's runs in it when it forks: a fork of the test process, whose pools may
run (two threads in a fresh-clone CI run), deadlocked a child on a futex. Each child is a process like any, stopped
by a real SIGINT or SIGKILL.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.context
import os
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from multiprocessing import forkserver
from pathlib import Path

from probe.cli.app import main

TESTS = Path(__file__).parent
PRELOAD = ["torch", "transformers", "transformers.models.llama.modeling_llama",
           "transformers.tokenization_utils_tokenizers", "probe.cli.app", __name__]
"""What the fork server imports before it forks (imports only: no torch op runs there): the soak's tiny llama and the
tokenizers transformers imports lazily, ~1.7 s of each child's run otherwise; this module, what each child runs, by
name."""


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """os.environ with `values` set, as it was after."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def server() -> multiprocessing.context.ForkServerContext:
    """The fork server's context, the server started (once a session) with OMP_NUM_THREADS=1 in its environment and
    this folder and the checkout first on its path (it imports PRELOAD from there, as this process does)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    path = os.pathsep.join([str(TESTS), str(TESTS.parent), *filter(None, [os.environ.get("PYTHONPATH")])])
    with environment(OMP_NUM_THREADS="1", PYTHONPATH=path):
        forkserver.ensure_running()
    return context


def run(args: list[str], cache: str, err: str) -> None:
    """In the child: `probe ARGS` as `python -m probe.cli` runs it (its stderr to `err`), then exit with its code."""
    code = 1
    try:
        os.environ.update(PROBE_CACHE=cache, OMP_NUM_THREADS="1")
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the server ignores SIGINT; a run stops on it
        sys.stdout, sys.stderr = open(os.devnull, "w"), open(err, "w", encoding="utf-8", buffering=1)  # noqa: SIM115
        os.dup2(sys.stdout.fileno(), 1)
        os.dup2(sys.stderr.fileno(), 2)
        sys.argv = ["probe", *args]
        main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    except BaseException:  # reported in its stderr, as Python would
        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code)


class Child:
    """`probe ARGS` in a child of the fork server. The same interface as subprocess.Popen, as far as the soak uses
    it: poll, send_signal, communicate (stderr), returncode (negative: the signal that ended it)."""

    def __init__(self, args: list[str], tmp_path: Path) -> None:
        self.err = tmp_path / f"stderr-{time.monotonic_ns()}.txt"
        self.process = server().Process(target=run, args=(args, str(tmp_path / "cache"), str(self.err)))
        self.process.start()
        self.pid = self.process.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self.process.exitcode is not None:
            self.returncode = self.process.exitcode
            self.process.close()
        return self.returncode

    def send_signal(self, kind: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, kind)

    def communicate(self, timeout: float) -> tuple[None, str]:
        if self.returncode is None:
            self.process.join(timeout)
        if self.poll() is None:
            self.process.kill()
            raise AssertionError(f"probe {self.pid} ran past {timeout} s")
        return None, self.err.read_text(encoding="utf-8") if self.err.exists() else ""

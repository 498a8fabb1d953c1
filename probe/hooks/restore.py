"""Clean-up that a second Ctrl-C cannot cut short: every installer records an idempotent undo step before it changes
the model, and `restoring()` runs them all with SIGINT deferred, a failing step not stopping the others and an
interrupted one run again."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from probe.hooks.types import Undo

ATTEMPTS = 3  # tries of a step that keeps being interrupted; steps are idempotent


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold SIGINT for the body; an interrupt that arrived is delivered (as the previous handler would) after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def remember(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)

    try:
        previous: Any = signal.signal(signal.SIGINT, remember)
    except (ValueError, OSError):  # no signals here (an embedded interpreter): nothing to defer
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received and callable(previous):
            previous(signal.SIGINT, None)
        elif received and previous != signal.SIG_IGN:
            raise KeyboardInterrupt


def put_back(module: Any, name: str, saved: Any) -> None:
    """Put `saved` back as the module's own attribute `name` (in its __dict__); None: remove the one set since."""
    if saved is None:
        module.__dict__.pop(name, None)
    else:
        module.__dict__[name] = saved


@contextmanager
def restoring() -> Iterator[list[Undo]]:
    """A list to append undo steps to; on exit they run in reverse order, whatever happened in the body, each one even
    when some raise; then the first error is raised (an interrupt first of all)."""
    steps: list[Undo] = []
    try:
        yield steps
    finally:
        errors: list[BaseException] = []
        with interrupts_deferred():
            for step in reversed(steps):
                for _ in range(ATTEMPTS):
                    try:
                        step()
                        break
                    except KeyboardInterrupt as interrupt:  # an interrupted step may be half done: run it again
                        errors.insert(0, interrupt)
                    except Exception as error:
                        errors.append(error)
                        break
        if errors:
            raise errors[0]

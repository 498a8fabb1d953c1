"""What the user sees while a command runs: stdout for reports, stderr for spinners, progress bars and notes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

console = Console()
errors = Console(stderr=True)


def note(message: str) -> None:
    """One plain line on stderr (no rich markup: paths and model names are printed as they are)."""
    errors.print(message, markup=False, highlight=False, soft_wrap=True)


def status(message: str, enabled: bool = True) -> AbstractContextManager[Any]:
    """A spinner on stderr while something without a count runs (nothing where `enabled` is False)."""
    return errors.status(message) if enabled else nullcontext()


@contextmanager
def progress_bar(description: str) -> Iterator[Callable[[int, int], None]]:
    """A rich progress bar with ETA on stderr; yields a `(done, total)` callback for the library."""
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=errors, transient=True) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


@contextmanager
def sweep_progress(description: str, enabled: bool = True) -> Iterator[tuple[Callable[[int, int], None],
                                                                              Callable[[Any], None]]]:
    """A progress bar with ETA (work is counted in block-forwards, so early layers weigh more) and heads done."""
    if not enabled:
        yield (lambda done, total: None), (lambda result: None)
        return
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(),
                  TextColumn("{task.fields[heads]}"), TimeElapsedColumn(), TimeRemainingColumn(), console=errors,
                  transient=True) as bar:
        task = bar.add_task(description, total=None, heads="")
        finished = [0]

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        def on_result(_result: Any) -> None:
            finished[0] += 1
            bar.update(task, heads=f"{finished[0]} heads done")

        yield update, on_result

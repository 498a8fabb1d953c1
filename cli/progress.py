"""What the user sees while a command runs: stdout for reports; stderr for spinners, progress, notes, warnings and
errors. Progress is probe.progress's Bars on the errors console: a live bar on a terminal, a line at every tenth and
at least every 30 seconds in a log file (a cluster job, `2> log`), with its time left once a tenth of the stage is
done; a step without a count (loading the model) is named once it has taken 2 seconds, then every 30 seconds, then
timed. `-q` leaves only warnings and errors; nothing here wraps text that is not on a terminal.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import IO, Any, ClassVar, TextIO

from rich.console import Console

from probe import progress as library
from probe.progress import Bars, StageProgress

UNWRAPPED = 4096  # columns of a console that is not a terminal: lines and tables keep their natural width
ANNOUNCE_AFTER = 2.0  # `status`, `timed_status`: work that takes longer says what it is doing, and when it is done


def _width(stream: TextIO) -> int | None:
    """A terminal's own width (rich finds it); elsewhere no wrapping at 80 columns, unless COLUMNS says otherwise."""
    interactive = hasattr(stream, "isatty") and stream.isatty()
    return None if interactive or "COLUMNS" in os.environ else UNWRAPPED


console = Console(width=_width(sys.stdout))
errors = Console(stderr=True, width=_width(sys.stderr))
_state = {"quiet": False}


def set_quiet(quiet: bool) -> None:
    """`-q`: no progress and no notes from now on; warnings and errors are still shown."""
    _state["quiet"] = quiet


def quiet() -> bool:
    """Whether `-q` is in force (no progress, no notes)."""
    return bool(_state["quiet"])


def _printable(text: str, stream: IO[str]) -> str:
    """Text as `stream` can encode it: what it cannot (a lone surrogate, from argv bytes that are not UTF-8 quoted
    in an error; a character outside its encoding) as a backslash escape, as Python's own stderr writes it. A stream
    of strict UTF-8 (a test's, a notebook's) raised instead, and rich kept the line to raise again at the next."""
    encoding = getattr(stream, "encoding", None) or "utf-8"
    return text.encode(encoding, "backslashreplace").decode(encoding)


def _say(message: str) -> None:
    errors.print(_printable(message, errors.file), markup=False, highlight=False, soft_wrap=True)


def note(message: str) -> None:
    """One plain line on stderr (no rich markup: paths and model names are printed as they are); none with -q."""
    if not _state["quiet"]:
        _say(message)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, after a command saved what had finished: its message is the one line the command line prints
    ("interrupted; ... saved in X"), where a bare KeyboardInterrupt prints "interrupted" alone. typer turns any
    Ctrl-C into exit code 130 and drops the exception: `take()` hands the entry point the last one raised."""

    _last: ClassVar[list[Interrupted]] = []

    def __init__(self, message: str) -> None:
        super().__init__(message)
        Interrupted._last[:] = [self]

    @classmethod
    def take(cls) -> KeyboardInterrupt:
        """The last Interrupted raised (forgotten now), or a bare KeyboardInterrupt."""
        last = cls._last[:1]
        cls._last.clear()
        return last[0] if last else KeyboardInterrupt()


def warn(message: str) -> None:
    """A warning or an error: one plain line on stderr, also with -q."""
    _say(message)


def _showing(enabled: bool) -> bool:
    return enabled and not _state["quiet"]


def status(message: str, enabled: bool = True) -> AbstractContextManager[Any]:
    """A spinner on stderr while something without a count runs (`capturing attention ...`); off a terminal the same
    words as a line once it has run ANNOUNCE_AFTER seconds, again every 30 seconds, and `capturing attention: done in
    7.2 s` at its end. Nothing where `enabled` is False or with -q."""
    if not _showing(enabled):
        return nullcontext()
    return _announced(message, f"{message.removesuffix(' ...')}: done", on_terminal=False)


def timed_status(doing: str, done: str) -> AbstractContextManager[Any]:
    """`status(f"{doing} ...")` that also says `{done} in 7.2 s` on a terminal (loading a model: how long the next
    run will wait for it too)."""
    return _announced(f"{doing} ...", done, on_terminal=True) if _showing(True) else nullcontext()


@contextmanager
def _announced(doing: str, done: str, on_terminal: bool) -> Iterator[None]:
    """A spinner saying `doing` on a terminal; off one, Bars of a step without a total (a line once it has run
    ANNOUNCE_AFTER seconds, another every 30 seconds). Then `done in 7.2 s` where it took that long (on a terminal
    only with `on_terminal`). Work done in a moment says nothing, and an error in it stays the only line."""
    started = library.monotonic()
    if errors.is_terminal:
        with errors.status(doing):
            yield
    else:
        with Bars(doing, first=ANNOUNCE_AFTER, console=errors):
            yield
    seconds = library.monotonic() - started
    if seconds >= ANNOUNCE_AFTER and (on_terminal or not errors.is_terminal):
        _say(f"{done} in {seconds:.1f} s")


@contextmanager
def progress_bar(description: str, unit: str | None = None) -> Iterator[Callable[[int, int], None]]:
    """Progress with a count (in `unit`, e.g. "checkpoints"; without one, a share), its rate and time left on stderr;
    yields the `(done, total)` callback."""
    if not _showing(True):
        yield lambda done, total: None
        return
    with Bars(description, {description: unit} if unit else None, console=errors) as bars:
        yield bars


@contextmanager
def saved_on_interrupt(stream: Any, saved: Callable[[], str], show: bool = True) -> Iterator[None]:
    """Ctrl-C in the block: `Interrupted`, saying what is `saved()` in `stream` and how to continue (a process that
    does not report: the bare KeyboardInterrupt)."""
    try:
        yield
    except KeyboardInterrupt:
        if show:
            raise Interrupted(f"interrupted; {saved()} saved in {stream}: run the same command with --resume to "
                              "continue") from None
        raise


@contextmanager
def sweep_progress(description: str, enabled: bool = True) -> Iterator[tuple[Callable[[int, int], None],
                                                                              Callable[[Any], None]]]:
    """Progress of a sweep (a share of its work) with the heads done after it; yields the `(done, total)` and the
    per-result callbacks."""
    if not _showing(enabled):
        yield (lambda done, total: None), (lambda result: None)
        return
    with Bars(description, console=errors) as bars:
        finished = [0]

        def on_result(_result: Any) -> None:
            finished[0] += 1
            bars.note(f"({finished[0]} head{'' if finished[0] == 1 else 's'} done)")

        yield bars, on_result


@contextmanager
def stage_progress(prefix: str, units: Mapping[str, str] | None = None) -> Iterator[StageProgress]:
    """Progress of work in named stages, a bar per stage as it starts (`prefix: stage`), each counted in the unit
    the library declares for it in `units` (else as a share); yields the `(stage, done, total)` callback."""
    if not _showing(True):
        yield lambda stage, done, total: None
        return
    with Bars(prefix, units, console=errors) as bars:
        yield bars.stage

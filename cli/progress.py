"""Reports go to stdout; spinners, progress (probe.progress's Bars: a live bar, or lines in a log file), notes,
warnings and errors to stderr. `-q` leaves warnings and errors; no text off a terminal is wrapped."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import IO, Any, ClassVar, TextIO

from rich.console import Console

from probe import progress as library
from probe.progress import Bars

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


def _printable(text: str, stream: IO[str]) -> str:
    """Text as `stream` can encode it, the rest (a lone surrogate from argv) backslash-escaped as Python's stderr does:
    a strict stream raised, and rich kept the line to raise again at the next."""
    encoding = getattr(stream, "encoding", None) or "utf-8"
    return text.encode(encoding, "backslashreplace").decode(encoding)


def _say(message: str) -> None:
    errors.print(_printable(message, errors.file), markup=False, highlight=False, soft_wrap=True)


def note(message: str) -> None:
    """One plain line on stderr (no rich markup: paths and model names are printed as they are); none with -q."""
    if not _state["quiet"]:
        _say(message)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C after a command saved what had finished, its message the line printed. typer drops the exception for
    exit code 130: `take()` hands the entry point the last one raised."""

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
    """A spinner while something without a count runs (off a terminal: a line after ANNOUNCE_AFTER seconds and when
    done)."""
    if not _showing(enabled):
        return nullcontext()
    return _announced(message, f"{message.removesuffix(' ...')}: done", on_terminal=False)


def timed_status(doing: str, done: str) -> AbstractContextManager[Any]:
    """`status` that also says `{done} in 7.2 s` on a terminal (loading a model: the next run waits as long)."""
    return _announced(f"{doing} ...", done, on_terminal=True) if _showing(True) else nullcontext()


@contextmanager
def _announced(doing: str, done: str, on_terminal: bool) -> Iterator[None]:
    """A spinner, or off a terminal Bars without a total; then `done in 7.2 s` where it took ANNOUNCE_AFTER. Work done
    in a moment says nothing, and an error in it stays the only line."""
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
def progress_bar(label: str, units: str | Mapping[str, str] | None = None, show: bool = True) -> Iterator[Bars | None]:
    """Bars on stderr: `(done, total)`, or `.stage` for work in stages, counted in `units` (one unit: the label's;
    else a share); None, which the library takes for no progress, with -q or where `show` is False."""
    if not _showing(show):
        yield None
        return
    with Bars(label, {label: units} if isinstance(units, str) else units, console=errors) as bars:
        yield bars


@contextmanager
def saved_on_interrupt(stream: Any, saved: Callable[[], str], show: bool = True) -> Iterator[None]:
    """Ctrl-C in the block: `Interrupted`, saying what is `saved()` in `stream` and how to continue."""
    try:
        yield
    except KeyboardInterrupt:
        if show:
            raise Interrupted(f"interrupted; {saved()} saved in {stream}: run the same command with --resume to "
                              "continue") from None
        raise


def heads_done(bars: Bars | None) -> Callable[[Any], None] | None:
    """A sweep's `on_result`: `(12 heads done)` after its bar (None without one)."""
    if bars is None:
        return None
    finished = [0]

    def on_result(_result: Any) -> None:
        finished[0] += 1
        bars.note(f"({finished[0]} head{'' if finished[0] == 1 else 's'} done)")

    return on_result

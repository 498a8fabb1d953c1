"""What the user sees while a command runs: stdout for reports; stderr for spinners, progress, notes, warnings and
errors. On a terminal progress is a live bar; in a log file (a cluster job, `2> log`) it is a plain line every 10% of
the work and at least every 30 seconds (a heartbeat thread says how far the work is when the library has reported
nothing for that long), each stage of a staged command named as it starts, a time left only once a tenth of the
stage's work is done (measured from that stage's own rate), and a step without a count (loading the model) named once
it has taken 2 seconds, then every 30 seconds, then timed. `-q` leaves only warnings and errors; nothing here wraps
text that is not on a terminal. Every time read here comes from `monotonic` (tests put a fake clock there, and a
fake `heartbeat` that they drive themselves).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import IO, Any, ClassVar, TextIO

from rich.console import Console
from rich.progress import (BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

from probe.progress import heartbeat as beating

UNWRAPPED = 4096  # columns of a console that is not a terminal: lines and tables keep their natural width
EVERY_SECONDS = 30.0  # plain progress: at most this long between two lines
EVERY_FRACTION = 10  # plain progress: a line at every tenth of the work
MIN_GAP = 1.0  # plain progress: at least this long between two lines (and before the first)
ANNOUNCE_AFTER = 2.0  # `status`, `timed_status`: work that takes longer says what it is doing, and when it is done
ESTIMATE_AFTER = 0.1  # plain progress: the time left is shown once this share of the stage's work is done
BEAT = 1.0  # seconds between two looks of the heartbeat thread: a silent gap is at most EVERY_SECONDS
monotonic = time.monotonic  # the clock of every progress line (a test's fake clock replaces it)


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
    words as a line once it has run ANNOUNCE_AFTER seconds, and `capturing attention: done in 7.2 s` at its end.
    Nothing where `enabled` is False or with -q."""
    if not _showing(enabled):
        return nullcontext()
    return _announced(message, f"{message.removesuffix(' ...')}: done", on_terminal=False)


def timed_status(doing: str, done: str) -> AbstractContextManager[Any]:
    """`status(f"{doing} ...")` that also says `{done} in 7.2 s` on a terminal (loading a model: how long the next
    run will wait for it too)."""
    return _announced(f"{doing} ...", done, on_terminal=True) if _showing(True) else nullcontext()


def heartbeat(tick: Callable[[], None], period: float | None = None) -> AbstractContextManager[None]:
    """`tick()` every `period` (BEAT) seconds on a daemon thread while the block runs (each tick decides for itself
    whether a line is due): a library call that reports nothing for minutes still gets a line every 30 seconds."""
    return beating(tick, BEAT if period is None else period)


class Announcer:
    """Off a terminal, a step without a count: `doing` once it has run ANNOUNCE_AFTER seconds, then `doing` with its
    time elapsed every EVERY_SECONDS (`generating 20 tokens: 1:00 elapsed`), each from `tick()`."""

    def __init__(self, doing: str, now: Callable[[], float] | None = None) -> None:
        self.doing, self.now = doing, now or (lambda: monotonic())
        self.started = self.now()
        self.last_line: float | None = None
        self.lock = threading.Lock()

    def tick(self) -> None:
        with self.lock:
            now = self.now()
            if self.last_line is None:
                if now - self.started >= ANNOUNCE_AFTER:
                    self.last_line = now
                    _say(self.doing)
            elif now - self.last_line >= EVERY_SECONDS - BEAT:
                self.last_line = now
                _say(f"{self.doing.removesuffix(' ...')}: {clock(now - self.started)} elapsed")


@contextmanager
def _announced(doing: str, done: str, on_terminal: bool) -> Iterator[None]:
    """A spinner saying `doing` on a terminal; off one, a line saying it once the work has run ANNOUNCE_AFTER
    seconds, and another every 30 seconds. Then `done in 7.2 s` where it took that long (on a terminal only with
    `on_terminal`). Work done in a moment says nothing, and an error in it stays the only line (the error's own)."""
    started = monotonic()
    if errors.is_terminal:
        with errors.status(doing):
            yield
    else:
        with heartbeat(Announcer(doing).tick, min(BEAT, ANNOUNCE_AFTER / 4)):
            yield
    seconds = monotonic() - started
    if seconds >= ANNOUNCE_AFTER and (on_terminal or not errors.is_terminal):
        _say(f"{done} in {seconds:.1f} s")


def clock(seconds: float) -> str:
    """1:05, or 1:02:05 past an hour."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class PlainProgress:
    """Progress for a log file: `ablating heads: 44% (12 heads done), 1:05 elapsed, ~1:20 left`, one line at every
    tenth of the work and at least every 30 seconds (`tick()`, from the heartbeat, also when no work is reported),
    never a carriage return, never two lines within a second (work done in a moment says only that it is done).

    It ends at its total: the last line comes from `finish()`, once the work and every result are in (`12/12
    checkpoints`, every head counted), not from the last report, which can come before the last result. The time
    left is the rate measured since the first report of work done, not since the start (loading and set-up before
    the first unit would otherwise inflate every estimate), and it is shown only once ESTIMATE_AFTER of the work is
    done (an estimate from the first few units is often off by far more than 2x). `unit` names what is counted
    (`checkpoints`); without one, a share (the library's own unit, layers of batches or block-forwards, means
    nothing to a user)."""

    def __init__(self, description: str, *, unit: str | None = None,
                 now: Callable[[], float] | None = None, estimate: bool = True) -> None:
        self.description, self.unit, self.now = description, unit, now or (lambda: monotonic())
        self.estimate = estimate  # False: a total that is only a bound, or units of unequal cost: no time left
        self.started = self.now()
        self.lock = threading.Lock()
        self.last_line: float | None = None
        self.first: tuple[float, int] | None = None  # (time, done) of the first report of work done
        self.tenths, self.done, self.total = 0, 0, 0
        self.heads: int | None = None  # counted once a head is done

    def head_done(self, _result: Any = None) -> None:
        self.heads = (self.heads or 0) + 1

    def update(self, done: int, total: int) -> None:
        """The library's `(done, total)` callback: a line when a new tenth is reached or 30 s have passed."""
        if not total:
            return
        with self.lock:
            now, tenths = self.now(), EVERY_FRACTION * done // total
            self.done, self.total = done, total
            if self.first is None and done > 0:
                self.first = (now, done)
            since = now - (self.started if self.last_line is None else self.last_line)
            if done >= total or since < MIN_GAP or (tenths <= self.tenths and since < EVERY_SECONDS):
                return
            self.tenths, self.last_line = max(tenths, self.tenths), now
            _say(self.line(done, total, now))

    def tick(self) -> None:
        """The heartbeat's look: a line where EVERY_SECONDS have passed since the last one (or the start), at the
        work reported so far (a library call inside one unit of work reports nothing for minutes)."""
        with self.lock:
            now = self.now()
            since = now - (self.started if self.last_line is None else self.last_line)
            if self.total and self.done < self.total and since >= EVERY_SECONDS - BEAT:
                self.last_line = now
                _say(self.line(self.done, self.total, now))

    def finish(self) -> None:
        """The last line, at the total, once the work is done; none where it took under a second and nothing was
        said."""
        now = self.now()
        if self.total and (self.last_line is not None or now - self.started >= MIN_GAP):
            _say(self.line(self.total, self.total, now))

    def left(self, done: int, total: int, now: float) -> float | None:
        """Seconds left at the rate measured since the first report of work done; None before there is a rate and
        before ESTIMATE_AFTER of the work is done."""
        if (not self.estimate or self.first is None or done <= self.first[1] or now <= self.first[0]
                or done >= total or done < ESTIMATE_AFTER * total):
            return None
        return (total - done) * (now - self.first[0]) / (done - self.first[1])

    def line(self, done: int, total: int, now: float) -> str:
        percent = f"{100 * done // total}%"
        amount = f"{done}/{total} {self.unit} ({percent})" if self.unit else percent
        heads = f" ({self.heads} head{'' if self.heads == 1 else 's'} done)" if self.heads is not None else ""
        left = self.left(done, total, now)
        estimate = "" if left is None else f", ~{clock(round(left))} left"  # nearest: 1.9 s left is ~0:02
        return f"{self.description}: {amount}{heads}, {clock(now - self.started)} elapsed{estimate}"


def _bar_columns(unit: str | None) -> list[Any]:
    """A live bar's columns: what is counted, in its unit where it has one, else as a share."""
    amount = TextColumn(f"{{task.completed}}/{{task.total}} {unit}") if unit else TaskProgressColumn()
    return [TextColumn("[bold]{task.description}"), BarColumn(), amount]


@contextmanager
def progress_bar(description: str, unit: str | None = None, estimate: bool = True,
                 announce: bool = False) -> Iterator[Callable[[int, int], None]]:
    """Progress with a count (in `unit`, e.g. "checkpoints"; without one, a share) and the time left on stderr (a
    bar, or plain lines; no time left with `estimate` False: a total that only bounds the work, units of unequal
    cost); yields a `(done, total)` callback. `announce`: off a terminal, `description ...` said at the first
    report (a command's one stage, whose first unit can take minutes; after the library's checks, so that a refusal
    stays the only line)."""
    if not _showing(True):
        yield lambda done, total: None
    elif not errors.is_terminal:
        plain = PlainProgress(description, unit=unit, estimate=estimate)
        said: list[bool] = []

        def first_said(done: int, total: int) -> None:
            if not said:
                said.append(True)
                note(f"{description} ...")
            plain.update(done, total)

        with heartbeat(plain.tick):
            yield first_said if announce else plain.update
        plain.finish()
    else:
        left = [TimeRemainingColumn()] if estimate else []
        with Progress(*_bar_columns(unit), TimeElapsedColumn(), *left, console=errors, transient=True) as bar:
            task = bar.add_task(description, total=None)
            yield lambda done, total: bar.update(task, completed=done, total=total)


@contextmanager
def sweep_progress(description: str, enabled: bool = True) -> Iterator[tuple[Callable[[int, int], None],
                                                                              Callable[[Any], None]]]:
    """Progress with ETA (work is weighed by the parameters each run passes, so early layers weigh more) and heads
    done; yields the `(done, total)` and the per-result callbacks."""
    if not _showing(enabled):
        yield (lambda done, total: None), (lambda result: None)
        return
    if not errors.is_terminal:
        plain = PlainProgress(description)
        with heartbeat(plain.tick):
            yield plain.update, plain.head_done
        plain.finish()
        return
    with Progress(*_bar_columns(None), TextColumn("{task.fields[heads]}"), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=errors, transient=True) as bar:
        task = bar.add_task(description, total=None, heads="")
        finished = [0]

        def on_result(_result: Any) -> None:
            finished[0] += 1
            bar.update(task, heads=f"{finished[0]} heads done")

        yield (lambda done, total: bar.update(task, completed=done, total=total)), on_result


class StageLines:
    """The `(stage, done, total)` callback of `stage_progress`: a bar (or plain lines) per stage as it starts; `end()`
    ends the stage running (its last line) where the command does work of its own before the next stage (a plan's
    timed forward), so that the stage's last line says when it ended."""

    def __init__(self, scope: ExitStack, prefix: str, units: Mapping[str, str] | None,
                 bounded: Collection[str]) -> None:
        self.scope, self.prefix, self.units, self.bounded = scope, prefix, units or {}, bounded
        self.current: dict[str, Callable[[int, int], None]] = {}

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage not in self.current:
            self.end()
            if not errors.is_terminal:
                note(f"{self.prefix}{stage} ...")
            self.current[stage] = self.scope.enter_context(progress_bar(
                f"{self.prefix}{stage}", self.units.get(stage), estimate=stage not in self.bounded))
        self.current[stage](done, total)

    def end(self) -> None:
        self.scope.close()
        self.current.clear()


@contextmanager
def stage_progress(prefix: str, units: Mapping[str, str] | None = None,
                   bounded: Collection[str] = ()) -> Iterator[StageLines]:
    """Progress of work in named stages, one bar (or plain lines) per stage as it starts, each counted in the unit
    the library declares for it in `units` (else as a share), with no time left for a stage in `bounded` (its total
    only bounds its work); off a terminal a line names each stage as it starts (a stage that counts nothing, or only
    at its end, still says what is running). Yields the `(stage, done, total)` callback, a StageLines."""
    with ExitStack() as scope:
        yield StageLines(scope, prefix, units, bounded)

"""Progress and logging for library users. Every public library function that takes `progress` takes the same
keyword argument (`ProgressArg`, or `StageProgressArg` for work in stages) under `reports`: `progress=True` draws a
plain bar on stderr, drawn again at least every 30 seconds while the work reports nothing (a heartbeat thread, for
the time the call runs), a callable gets `(done, total)` (`(stage, done, total)`), None shows nothing; the function
reads it through `callback` / `stage_callback`. The library logs what it chose under the `probe` logger
(`logging.getLogger("probe")`)."""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

Progress = Callable[[int, int], None]
"""The one progress callback type: `(done, total)`, in each function's own unit of work (classify: layers of batches;
the sweep: thousandths of a full forward, weighed by parameters; kv_heads, track: their stages' steps). `total` may
grow while the work is counted."""
ProgressArg = bool | Progress | None
"""What a public function's `progress` keyword takes: True (a bar on stderr, with its heartbeat: `reports`), a
`(done, total)` callable, or None (False too: nothing shown)."""
StageProgress = Callable[[str, int, int], None]
"""Progress of work in named stages: `(stage, done, total)`, each stage counted in its own unit (the caller's module
names the units a user knows, e.g. the atlas' STAGE_UNITS; a stage without one is read as a share)."""
StageProgressArg = bool | StageProgress | None
"""What the `progress` keyword of work in stages takes: True (a bar per stage), a `(stage, done, total)` callable, or
None."""
log = logging.getLogger("probe")
WIDTH = 30  # characters of the bar
REDRAW = 0.1  # seconds: a bar is drawn at most this often from its reports
EVERY_SECONDS = 30.0  # seconds: a bar is drawn at least this often while its call runs, reports or not
BEAT = 1.0  # seconds between two looks of the heartbeat thread
P = ParamSpec("P")
T = TypeVar("T")


@contextmanager
def heartbeat(tick: Callable[[], None], period: float | None = None) -> Iterator[None]:
    """`tick()` every `period` (BEAT) seconds on a daemon thread while the block runs (each tick decides for itself
    whether a line is due): a call that reports nothing for minutes (one forward of a large model) still shows it
    runs."""
    stop = threading.Event()
    every = BEAT if period is None else period

    def beat() -> None:
        while not stop.wait(every):
            tick()

    thread = threading.Thread(target=beat, name="probe-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


class TextBar:
    """`label [#########.....] 12/40 0:05` on stderr, redrawn in place (at most 10 times a second), a newline at the
    end: enough for a notebook or a terminal without a dependency. `tick()` (the heartbeat's) draws it again with its
    time elapsed where EVERY_SECONDS have passed since it was last drawn (`label ... 0:30` before the first report).
    `now`: its clock (a test's fake one)."""

    def __init__(self, label: str, now: Callable[[], float] | None = None) -> None:
        self.label, self.now = label, now or time.monotonic
        self.started = self.now()
        self.drawn: float | None = None  # when it was last drawn
        self.done, self.total, self.ended = 0, 0, False
        self.lock = threading.Lock()

    def __call__(self, done: int, total: int) -> None:
        with self.lock:
            self.done, self.total = done, total
            now = self.now()
            if done >= total or self.drawn is None or now - self.drawn >= REDRAW:
                self._draw(now)

    def tick(self) -> None:
        with self.lock:
            now = self.now()
            if not self.ended and now - (self.started if self.drawn is None else self.drawn) >= EVERY_SECONDS - BEAT:
                self._draw(now)

    def _draw(self, now: float) -> None:
        self.drawn, elapsed = now, int(now - self.started)
        since = f"{elapsed // 60}:{elapsed % 60:02d}"
        if not self.total:
            sys.stderr.write(f"\r{self.label} ... {since}")
        else:
            filled = WIDTH * min(self.done, self.total) // self.total
            self.ended = self.done >= self.total
            sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (WIDTH - filled)}] {self.done}/{self.total} "
                             f"{since}" + ("\n" if self.ended else ""))
        sys.stderr.flush()


class StageBars:
    """A TextBar per stage (`label: stage`), the `(stage, done, total)` callback; `tick()` ticks the stage running."""

    def __init__(self, label: str, now: Callable[[], float] | None = None) -> None:
        self.label, self.now = label, now
        self.bars: dict[str, TextBar] = {}
        self.current: TextBar | None = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage not in self.bars:
            self.bars[stage] = TextBar(f"{self.label}: {stage}", self.now)
        self.current = self.bars[stage]
        self.current(done, total)

    def tick(self) -> None:
        if self.current is not None:
            self.current.tick()


def reports(label: str, stages: bool = False) -> Callable[[Callable[P, T]], Callable[P, T]]:
    """A library function's `progress=True` (a keyword argument): its TextBar (with `stages`, a bar per stage) made
    here, and drawn again by a heartbeat thread at least every EVERY_SECONDS while the function runs, also where its
    work reports nothing for minutes; the thread ends with the call, also on an error or Ctrl-C. The function gets the
    bar as its callable, and passes a callable on to the reported functions it calls: one bar, one thread. Under
    torchrun only the first process draws one (`_shows_progress`); the others get None."""
    def wrap(function: Callable[P, T]) -> Callable[P, T]:
        @functools.wraps(function)
        def run(*args: P.args, **kwargs: P.kwargs) -> T:
            if kwargs.get("progress") is not True:
                return function(*args, **kwargs)
            if not _shows_progress():
                kwargs["progress"] = None
                return function(*args, **kwargs)
            bar = StageBars(label) if stages else TextBar(label)
            kwargs["progress"] = bar
            with heartbeat(bar.tick):
                return function(*args, **kwargs)
        return run
    return wrap


def _shows_progress() -> bool:
    """Whether this process draws `progress=True`'s bar: run alone, or torchrun's first process (each process's bar
    would show its own share of the work; the first's stands for all, docs/large-models.md)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) <= 1 or int(os.environ.get("RANK", "0")) == 0
    except ValueError:
        return True  # not torchrun's: its variables are integers


def callback(progress: ProgressArg, label: str) -> Progress | None:
    """The `(done, total)` callback a `progress` argument asks for: True a TextBar, a callable itself, else None."""
    if progress is True:
        return TextBar(label)
    return progress if callable(progress) else None


def stage_callback(progress: StageProgressArg, label: str) -> StageProgress | None:
    """The `(stage, done, total)` callback a `progress` argument asks for: True a TextBar per stage (`label: stage`), a
    callable itself, else None."""
    if progress is not True:
        return progress if callable(progress) else None
    return StageBars(label)


def stage_tick(progress: StageProgress | None, stage: str) -> Progress | None:
    """One stage's `(done, total)` callback, reported at 0 at once: the stage says what it is doing before its first
    unit of work is done (and where it counts none)."""
    if progress is None:
        return None
    report = progress

    def tick(done: int, total: int) -> None:
        report(stage, done, total)

    tick(0, 1)
    return tick

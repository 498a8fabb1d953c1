"""Progress of library calls: `progress` is a `(done, total)` (or `(stage, done, total)`) callable, None, or True
for `Bars` on stderr; choices are logged under the `probe` logger. `Bars` is rich's bar per stage, for the library
and the CLI alike. Off a terminal (a log file, a cluster job) a row is a line at every tenth and at least every
EVERY_SECONDS, from a heartbeat thread while one long forward reports nothing."""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import ParamSpec, TypeVar

from rich.console import Console
from rich.table import Column
from rich.progress import BarColumn, ProgressColumn, Task, TaskID, TextColumn
from rich.progress import Progress as RichProgress
from rich.text import Text

Progress = Callable[[int, int], None]
"""`(done, total)` in the function's own unit; `total` may grow."""
ProgressArg = bool | Progress | None
"""A public function's `progress`: True (Bars on stderr), a `(done, total)` callable, or None."""
StageProgress = Callable[[str, int, int], None]
"""`(stage, done, total)`, each stage in its own unit (a module's STAGE_UNITS; else shown as a share)."""
StageProgressArg = bool | StageProgress | None
"""The `progress` of work in stages: True (a bar per stage), a StageProgress, or None."""
log = logging.getLogger("probe")
EVERY_SECONDS = 30.0  # off a terminal: at most this long between two lines
FIRST_TENTH = 0.1  # the time left is shown once this share of a stage is done
MIN_GAP = 1.0  # off a terminal: at least this long between two lines of a stage's tenths
BEAT = 1.0  # seconds between two looks of the heartbeat thread
UNWRAPPED = 4096  # columns of a console that is not a terminal: a line keeps its natural width
monotonic = time.monotonic  # the clock of every bar (a test's fake clock replaces it)
P = ParamSpec("P")
T = TypeVar("T")
C = TypeVar("C", bound=Callable[..., None])


def clock(seconds: float) -> str:
    """1:05, or 1:02:05 past an hour."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def rate(task: Task) -> float | None:
    """Units a second since the stage's first count (`since`: a model's load is no part of the rate)."""
    since = task.fields.get("since")
    if since is None or task.start_time is None:
        return None
    seconds = (task.elapsed or 0.0) - (since[0] - task.start_time)
    return (task.completed - since[1]) / seconds if seconds > 0 else None


def left(task: Task) -> float | None:
    """Seconds left at the stage's `rate`, once FIRST_TENTH of it is done; else None."""
    speed, total, done = rate(task), task.total, task.completed
    if task.stop_time is not None or not speed or not total or done < FIRST_TENTH * total or done >= total:
        return None
    return (total - done) / speed


def _number(value: float) -> str:
    """`380`, `12`, `2.1`, `0.25`: two significant digits, or the whole number past 10."""
    return f"{value:.0f}" if value >= 10 else f"{value:.2g}"


class Counts(ProgressColumn):
    """`12/40 heads, 0.8/s, 1:05 elapsed, ~1:20 left` (`30%, 2.1%/min, ...` without a unit)."""

    def render(self, task: Task) -> Text:
        elapsed, unit = task.elapsed or 0.0, task.fields.get("unit")
        if not task.total:
            return Text(f"{clock(elapsed)} elapsed")
        speed = rate(task)
        said = f"{task.completed:g}/{task.total:g} {unit}" if unit else f"{task.percentage:.0f}%"
        if speed and unit:
            said += f", {_number(speed)}/s"
        elif speed:
            per_minute = 60 * 100 * speed / task.total
            said += f", {_number(per_minute)}%/min" if per_minute < 100 else f", {_number(per_minute / 60)}%/s"
        remaining = left(task)
        return Text(f"{said}, {clock(elapsed)} elapsed" + ("" if remaining is None else
                                                            f", ~{clock(round(remaining))} left"))


class Bars:
    """rich's bar per stage on stderr (`__call__`: `(done, total)`; `stage`: staged); `with` it while the work runs."""

    def __init__(self, label: str, units: Mapping[str, str] | None = None, *, first: float = EVERY_SECONDS,
                 console: Console | None = None, now: Callable[[], float] | None = None) -> None:
        self.label, self.units, self.first = label, units or {}, first
        terminal = getattr(sys.stderr, "isatty", lambda: False)()
        self.console = console or Console(stderr=True, width=None if terminal else UNWRAPPED)
        self.live = self.console.is_terminal  # off a terminal: lines, without the bar's glyphs (no colour there)
        self.rich = RichProgress(TextColumn("{task.description}"), *([BarColumn(bar_width=20)] if self.live else []),
                                 Counts(table_column=Column(no_wrap=True)),
                                 TextColumn("{task.fields[note]}"), console=self.console,
                                 get_time=now or (lambda: monotonic()), transient=False, redirect_stdout=False)
        self.current: TaskID | None = None
        self.stages: dict[str, TaskID] = {}
        self.said: float | None = None  # when the running stage's last line was said
        self.tenths = 0
        self.lock, self.stop = threading.Lock(), threading.Event()
        self.thread = threading.Thread(target=self._beat, name="probe-progress", daemon=True)

    def __call__(self, done: int, total: int) -> None:
        self.stage(self.label, done, total)

    def stage(self, stage: str, done: int, total: int | None) -> None:
        with self.lock:
            if stage not in self.stages:
                self._end()
                description = stage if stage == self.label else f"{self.label}: {stage}"
                self.stages[stage] = self.rich.add_task(description, total=total or None,
                                                        unit=self.units.get(stage), note="")
                self.current, self.said, self.tenths = self.stages[stage], None, 0
            self.rich.update(self.stages[stage], completed=done, total=total or None)
            task = self.rich.tasks[self.stages[stage]]
            if total and "since" not in task.fields:
                task.fields["since"] = (self.rich.get_time(), done)
            tenths = int(10 * done // total) if total else 0
            if not self.live and tenths > self.tenths and self._since(task) >= MIN_GAP and done < (total or 0):
                self.tenths = tenths
                self._line(task)

    def note(self, text: str) -> None:
        """Words after the running stage's row (`12 heads done`)."""
        if self.current is not None:
            self.rich.update(self.current, note=text)

    def tick(self) -> None:
        """Off a terminal, the running stage's row once EVERY_SECONDS (`first` before its first) have passed."""
        with self.lock:
            task = self.rich.tasks[self.current] if self.current is not None else None
            every = EVERY_SECONDS - 1.5 * BEAT  # looked at every BEAT: due a beat early, said before EVERY_SECONDS
            due = every if self.said is not None else min(self.first - BEAT / 2, every)
            if task is not None and not self.live and not task.finished and self._since(task) >= due:
                self._line(task)

    def _since(self, task: Task) -> float:
        return (task.elapsed or 0.0) if self.said is None else self.rich.get_time() - self.said

    def _line(self, task: Task) -> None:
        self.said = self.rich.get_time()
        row = Text(" ").join([Text(task.description), Counts().render(task), Text(task.fields["note"])])
        row.rstrip()
        self.console.print(row, soft_wrap=True)

    def _end(self) -> None:
        """The running stage's last line (off a terminal: where it took MIN_GAP or more or said a line)."""
        if self.current is None:
            return
        task = self.rich.tasks[self.current]
        self.rich.stop_task(self.current)
        if not task.total:  # the row before the first report, or a step without a count: its caller says its end
            self.rich.update(self.current, visible=False)
        else:  # ended: its work is done (a stage that stops early, or counts only at its end, included)
            self.rich.update(self.current, completed=task.total)
            if not self.live and (self.said is not None or (task.elapsed or 0.0) >= MIN_GAP):
                self._line(task)

    def _beat(self) -> None:
        while not self.stop.wait(BEAT):
            self.tick()

    def __enter__(self) -> Bars:
        self.stage(self.label, 0, None)  # a row from the start: said after `first` seconds, before any report
        if self.live:
            self.rich.start()
        else:
            self.thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()
        with self.lock:
            if kind is None:
                self._end()
        if self.live:
            self.rich.stop()


def reports(label: str, stages: bool = False) -> Callable[[Callable[P, T]], Callable[P, T]]:
    """`progress=True`: Bars named `label` for the call (ended on Ctrl-C too); under torchrun the first process's."""
    def wrap(function: Callable[P, T]) -> Callable[P, T]:
        @functools.wraps(function)
        def run(*args: P.args, **kwargs: P.kwargs) -> T:
            if kwargs.get("progress") is not True:
                return function(*args, **kwargs)
            if not _shows_progress():
                kwargs["progress"] = None
                return function(*args, **kwargs)
            with Bars(label) as bars:
                kwargs["progress"] = bars.stage if stages else bars
                return function(*args, **kwargs)
        return run
    return wrap


def _shows_progress() -> bool:
    """Run alone, or torchrun's first process: its share stands for all (docs/large-models.md)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) <= 1 or int(os.environ.get("RANK", "0")) == 0
    except ValueError:
        return True  # not torchrun's: its variables are integers


def callback(progress: C | bool | None) -> C | None:
    """The callback a `progress` argument gives (`reports` made True's), else None."""
    return progress if callable(progress) else None


def counter(progress: Progress | None, total: int) -> Callable[[], None]:
    """A step that counts itself and reports `(done, total)` to `progress` (nothing without one)."""
    done = [0]

    def step() -> None:
        done[0] += 1
        if progress is not None:
            progress(done[0], total)

    return step


def stage_tick(progress: StageProgress | None, stage: str) -> Progress | None:
    """One stage's `(done, total)` callback, reported at 0 at once: the stage is named before its first unit."""
    if progress is None:
        return None
    progress(stage, 0, 1)
    return functools.partial(progress, stage)

"""Progress and logging for library users: `progress=True` draws a plain bar on stderr, a callable gets
`(done, total)`; the library logs what it chose under the `probe` logger (`logging.getLogger("probe")`)."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable

Progress = Callable[[int, int], None]
"""The one progress callback type: `(done, total)`, in each function's own unit of work (classify: layers of batches;
the sweep: thousandths of a full forward, weighed by parameters; kv_heads, track: their stages' steps). `total` may
grow while the work is counted."""
ProgressArg = bool | Progress | None
StageProgress = Callable[[str, int, int], None]
"""Progress of work in named stages: `(stage, done, total)`, each stage counted in its own unit (the caller's module
names the units a user knows, e.g. the atlas' STAGE_UNITS; a stage without one is read as a share)."""
StageProgressArg = bool | StageProgress | None
log = logging.getLogger("probe")
WIDTH = 30  # characters of the bar


class TextBar:
    """`label [#########.....] 12/40 0:05` on stderr, redrawn in place (at most 10 times a second), a newline at the
    end: enough for a notebook or a terminal without a dependency."""

    def __init__(self, label: str) -> None:
        self.label, self.started, self.drawn = label, time.monotonic(), 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - self.drawn < 0.1:
            return
        self.drawn = now
        filled = WIDTH * done // max(total, 1)
        elapsed = int(now - self.started)
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (WIDTH - filled)}] {done}/{total} "
                         f"{elapsed // 60}:{elapsed % 60:02d}" + ("\n" if done >= total else ""))
        sys.stderr.flush()


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
    bars: dict[str, TextBar] = {}
    return lambda stage, done, total: bars.setdefault(stage, TextBar(f"{label}: {stage}"))(done, total)


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

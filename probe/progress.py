"""Progress and logging for library users: `progress=True` draws a plain bar on stderr, a callable gets
`(done, total)`; the library logs what it chose under the `probe` logger (`logging.getLogger("probe")`)."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable

Progress = Callable[[int, int], None]
"""The one progress callback type: `(done, total)`, in each function's own unit of work (classify: layers of batches;
the sweep: block-forwards; kv_heads, track: their stages' steps). `total` may grow while the work is counted."""
ProgressArg = bool | Progress | None
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

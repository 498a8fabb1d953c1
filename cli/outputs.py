"""The files a command writes: checked before any work, written before the terminal report, strict JSON, and one
warning when a result holds numbers that are not finite."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from probe.cli.progress import note, warn
from probe.errors import ProbeError
from probe.reports.files import check_writable, non_finite_heads

SHOWN_HEADS = 10  # heads named in the non-finite warning


def check_distinct(files: dict[str, Path | None]) -> None:
    """No two outputs at one path: the second write would replace the first. `files` maps flags to paths or None."""
    seen: dict[Path, str] = {}
    for flag, path in files.items():
        if path is None:
            continue
        key = path.resolve()
        if key in seen:
            raise ProbeError(f"{seen[key]} and {flag} both name {path}: give each output its own file")
        seen[key] = flag


def check_outputs(files: dict[str, Path | None], *, force: bool) -> None:
    """Before any work: the outputs are distinct, and none replaces an existing file without `force`."""
    check_distinct(files)
    for path in files.values():
        if path is not None:
            check_writable(path, force=force)


def save(path: Path | None, write: Callable[[Path], Any]) -> None:
    """Write one output (`write(path)`, atomic in reports.files) where its flag was given, and say so."""
    if path is not None:
        write(path)
        note(f"wrote {path}")


def warn_non_finite(payload: dict[str, Any]) -> None:
    """One line naming the heads whose numbers are NaN or infinite (half precision overflowing, usually)."""
    heads = non_finite_heads(payload)
    if not heads:
        return
    shown = ", ".join(heads[:SHOWN_HEADS]) + (f" and {len(heads) - SHOWN_HEADS} more" if len(heads) > SHOWN_HEADS
                                              else "")
    warn(f"warning: numbers that are not finite (NaN or infinity) for {shown}; JSON writes them as null. "
         "Half precision often overflows: try --dtype float32")

"""Writing result files: never overwrite silently, never leave half a file behind."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from probe.errors import ProbeError


def check_writable(path: str | Path, *, force: bool) -> Path:
    """Refuse to replace an existing file unless `force`; check the folder exists before any work is done."""
    target = Path(path)
    if target.is_dir():
        raise ProbeError(f"{target} is a folder: give a file name")
    if target.exists() and not force:
        raise ProbeError(f"{target} exists: pass --force to overwrite it, or choose another name")
    if not target.parent.exists():
        raise ProbeError(f"folder {target.parent} does not exist: create it first")
    return target


def write_text(path: str | Path, text: str) -> Path:
    """Write atomically: a temporary file in the same folder, then a rename."""
    target = Path(path)
    handle, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a report should be as readable as any new file
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return target


def write_json(path: str | Path, data: dict[str, Any]) -> Path:
    return write_text(path, json.dumps(data, indent=2) + "\n")

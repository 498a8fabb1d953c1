"""Writing the library's own files whole or not at all: an interrupted write leaves the old file or none (the
rendered files go through reports/files.py, which the library cannot import)."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    """`text` into `path` through `.NAME.tmp` beside it, renamed over `path`."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)

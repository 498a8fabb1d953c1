"""The library's own files written whole or not at all (rendered ones go through reports/files.py)."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    """`text` into `path` through `.NAME.tmp` beside it, renamed over `path`."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)

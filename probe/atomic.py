"""Writing a file whole or not at all: the library's own files (results streams, head maps) go through here.

A temporary file beside the target, renamed over it: an interrupted write leaves the old file or none, never half of
one. (reports/files.py writes the files a command renders, with their provenance stamped in; the library cannot
import it.)
"""

from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    """`text` into `path` through `.NAME.tmp` beside it, renamed over `path`."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)

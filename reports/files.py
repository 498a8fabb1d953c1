"""Writing result files: never overwrite silently, never leave half a file behind, only strict JSON."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from probe.errors import ProbeError
from probe.reports.labels import short_label


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


def finite(data: Any) -> Any:
    """`data` with every NaN or infinity replaced by None: strict JSON has no such numbers (null instead)."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {key: finite(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite(value) for value in data]
    return data


def write_json(path: str | Path, data: dict[str, Any]) -> Path:
    """Strict JSON (non-finite numbers written as null), atomically."""
    return write_text(path, json.dumps(finite(data), indent=2, allow_nan=False) + "\n")


def write_csv(path: str | Path, rows: list[dict[str, Any]]) -> Path:
    """Rows with the same keys as CSV, columns in key order (atomically, like every output file)."""
    buffer = io.StringIO()
    if rows:
        writer = csv.DictWriter(buffer, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    return write_text(path, buffer.getvalue())


def _has_non_finite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_has_non_finite(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_non_finite(item) for item in value)
    return False


def non_finite_heads(payload: dict[str, Any]) -> list[str]:
    """Labels ('5.1', '5.1+18.6') of the entries of a classification or ablation payload that hold a NaN or an
    infinity, the baseline first when it has one."""
    labels = ["the baseline"] if _has_non_finite(payload.get("baseline_loss")) else []
    for entry in [*payload.get("heads", []), *payload.get("groups", [])]:
        if _has_non_finite(entry):
            labels.append(entry.get("label") or short_label(entry["layer"], entry["head"]))
    return labels

"""Every result file is written here: atomically, never over a file silently, strict JSON naming its schema first,
and the run's provenance (`stamp_outputs`) in JSON, in an HTML page, or in a CSV's sidecar (the CSV stays a plain
table). The provenance is made when the first file asks for it: a model hash takes seconds."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import tempfile
from pathlib import Path
from collections.abc import Callable
from typing import Any

from probe.errors import ProbeError
from probe.reports.html import provenance_block
from probe.reports.labels import short_label

Provenance = dict[str, Any] | Callable[[], dict[str, Any]]
_stamp: dict[str, Any] = {}  # "provenance": the dict every file written from now on carries, or what makes it


def stamp_outputs(provenance: Provenance | None) -> None:
    """Every file written from now on carries `provenance` (None: none): a dict, or a function called once for it."""
    _stamp.clear()
    if provenance is not None:
        _stamp["provenance"] = provenance


def current_stamp() -> dict[str, Any] | None:
    """The provenance files carry now, or None (made now if it was stamped as a function)."""
    provenance = _stamp.get("provenance")
    if callable(provenance):
        provenance = _stamp["provenance"] = provenance()
    return provenance


def provenance_path(path: str | Path) -> Path:
    """Where a CSV file's provenance goes: `heads.csv` -> `heads.provenance.json`, beside it."""
    target = Path(path)
    return target.with_name(f"{target.stem or target.name}.provenance.json")


def stamped(data: Any) -> Any:
    """A JSON payload with the run's provenance added (a dict that has none yet), else unchanged."""
    provenance = current_stamp()
    if provenance is None or not isinstance(data, dict) or "provenance" in data:
        return data
    return {**data, "provenance": provenance}


def _stamped_text(path: Path, text: str) -> str:
    """An HTML page with the provenance block before its last </body> (a fragment gets it at its end)."""
    provenance = current_stamp()
    if provenance is None or path.suffix.lower() not in (".html", ".htm") or 'id="probe-provenance"' in text:
        return text
    at = text.rfind("</body>")
    at = len(text) if at < 0 else at
    return text[:at] + provenance_block(provenance) + text[at:]


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
    text = _stamped_text(target, text)
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


def write_json(path: str | Path, data: dict[str, Any], *, schema: dict[str, Any] | None, stamp: bool = True) -> Path:
    """Strict JSON (non-finite numbers as null), `schema` (`probe.schemas.header(kind)`) first; None only with
    `stamp=False`: an export in another tool's format holds exactly what that tool reads."""
    if schema is None and stamp:
        raise ValueError("a JSON file probe writes names its schema (probe.schemas.header); exports pass stamp=False")
    named = {**schema, **data} if schema else data
    return write_text(path, json.dumps(finite(stamped(named) if stamp else named), indent=2, allow_nan=False) + "\n")


def write_csv(path: str | Path, rows: list[dict[str, Any]]) -> Path:
    """Rows of one set of keys as a CSV `pandas.read_csv` reads as it is; the provenance in its sidecar, written
    first."""
    buffer = io.StringIO()
    if rows:
        writer = csv.DictWriter(buffer, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    provenance = current_stamp()
    if provenance is not None:  # a small file of its own: not a result, so it names the file it describes
        write_text(provenance_path(path), json.dumps({"describes": Path(path).name, "provenance": finite(provenance)},
                                                     indent=2, allow_nan=False) + "\n")
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
    """Labels ('5.1', '5.1+18.6') of the entries holding a NaN or an infinity, the baseline first."""
    labels = ["the baseline"] if _has_non_finite(payload.get("baseline_loss")) else []
    for entry in [*payload.get("heads", []), *payload.get("groups", [])]:
        if _has_non_finite(entry):
            labels.append(entry.get("label") or short_label(entry["layer"], entry["head"], payload.get("layer_names")))
    return labels

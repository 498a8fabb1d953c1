"""Every result's `to_frame()` (pandas, an optional extra): rows and columns as its schema's `$defs.frame_row`."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from probe.errors import ProbeError, install_hint
from probe.schemas.declare import declarations


def frame(rows: list[dict[str, Any]]) -> Any:
    """A pandas DataFrame of `rows` (one dict per row, the same keys in each); ProbeError where pandas is missing."""
    try:
        pandas = importlib.import_module("pandas")
    except ImportError:
        raise ProbeError(f"to_frame() needs pandas, an optional extra: {install_hint('dataframe')} (or "
                         "pip install pandas)") from None
    return pandas.DataFrame.from_records(rows)


def head_name(layer: int, head: int, layer_names: Sequence[str] | None = None) -> str:
    """`L18H6`, never read as a number (an encoder-decoder's `x3.1`); reports' column_label writes the same."""
    return f"{layer_names[layer]}.{head}" if layer_names else f"L{layer}H{head}"


def head_columns(layer: int, head: int, layer_names: Sequence[str] | None = None) -> dict[str, Any]:
    """The three columns every per-head row starts with: layer, head, name."""
    return {"layer": layer, "head": head, "name": head_name(layer, head, layer_names)}


def head_rows(entries: list[dict[str, Any]], keys: Sequence[str], layer_names: Sequence[str] | None = None,
              **joined: str) -> list[dict[str, Any]]:
    """One row per payload entry: the head's columns, `keys` it has, `joined` lists comma-separated (by that field)."""
    rows = []
    for entry in entries:
        row = head_columns(entry["layer"], entry["head"], layer_names)
        row.update({key: entry[key] for key in keys if key in entry})
        for key, field in joined.items():
            if key in entry:
                row[key] = ",".join(str(item[field]) if isinstance(item, dict) else str(item) for item in entry[key])
        rows.append(row)
    return rows


def record_rows(records: Sequence[Any], layer_names: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """One row per head's record (a Payload): the head's columns, then each field it declares a column."""
    rows = []
    for item in records:
        row = head_columns(item.layer, item.head, layer_names)
        for declared in declarations(type(item)):
            value = getattr(item, declared.attribute)
            if declared.column is None or (value is None and not declared.field.required):
                continue
            row[declared.key] = ",".join(map(str, value)) if isinstance(value, list) else value
        rows.append(row)
    return rows

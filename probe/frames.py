"""pandas, an optional extra (`pip install 'probe-heads[dataframe]'`): results' `to_dataframe()` import it through
here."""

from __future__ import annotations

import importlib
from typing import Any

from probe.errors import ProbeError, install_hint


def dataframe(rows: list[dict[str, Any]]) -> Any:
    """A pandas DataFrame of `rows` (one dict per row, the same keys in each); ProbeError where pandas is missing."""
    try:
        pandas = importlib.import_module("pandas")
    except ImportError:
        raise ProbeError(f"to_dataframe() needs pandas, an optional extra: {install_hint('dataframe')} (or "
                         "pip install pandas)") from None
    return pandas.DataFrame.from_records(rows)

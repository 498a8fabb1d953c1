"""Every command that writes `--csv`, run on a tiny model (the commands of tests/page_kinds.py), writes a table that
plain `pandas.read_csv(path)` reads as it is: the header first, integer `layer` and `head`, the head's name in a
column called `name` in every command (`L18H6`, text), and the run's provenance beside it in `NAME.provenance.json`,
not in the table."""

from __future__ import annotations

import json
from pathlib import Path

import pandas
import pytest

import page_kinds

WRITERS = list(page_kinds.TABLES)  # each writes its table in the run that writes its page
PER_HEAD = [kind for kind in WRITERS if kind not in ("prune", "qk")]  # prune's rows are steps of a curve, qk's pairs
NAME = r"L\d+H\d+|L\d+KV\d+|L\d+H\d+(\+L\d+H\d+)+"  # compare over KV heads: L5KV1; heads ablated together: joined


@pytest.fixture(scope="module")
def tables(command_outputs: dict[str, Path]) -> dict[str, Path]:
    """Each command's CSV, written by the command itself, in the run that wrote its page (tests/conftest.py)."""
    written = {kind: command_outputs[kind].with_suffix(".csv") for kind in WRITERS}
    assert all(path.is_file() for path in written.values()), written
    return written


@pytest.mark.slow
@pytest.mark.parametrize("kind", WRITERS)
def test_pandas_reads_every_csv_as_it_is(kind: str, tables: dict[str, Path]) -> None:
    path = tables[kind]
    frame = pandas.read_csv(path)
    assert len(frame) > 0 and not any(str(column).startswith("#") for column in frame.columns), kind
    assert not path.read_text(encoding="utf-8").startswith("#")
    sidecar = json.loads(path.with_name(f"{kind}.provenance.json").read_text(encoding="utf-8"))
    assert sidecar["describes"] == path.name and "command" in sidecar["provenance"]
    if kind in PER_HEAD:
        assert frame["layer"].dtype.kind == "i" and frame["head"].dtype.kind == "i", (kind, frame.dtypes)
        assert pandas.api.types.is_string_dtype(frame["name"]), (kind, frame["name"].dtype)  # text, never numbers
        assert frame["name"].str.fullmatch(NAME).all(), (kind, frame["name"])
        assert "heads" not in frame.columns  # one head-name column, named as in every other command


def test_heads_ablated_together_share_the_name_column(tmp_path: Path) -> None:
    """A row of heads ablated together: its heads joined in `name`, and no layer or head it could not fill."""
    path = tmp_path / "together.csv"
    code, err = page_kinds.run([*page_kinds.COMMANDS["ablate"], "--heads", "0.1,1.2", "--together", "--csv",
                                str(path)])
    assert code == 0, err
    frame = pandas.read_csv(path)
    assert list(frame["name"]) == ["L0H1+L1H2"] and "layer" not in frame.columns and "heads" not in frame.columns

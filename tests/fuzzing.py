"""Strategies and checks shared by the property-based tests (tests/test_fuzz.py, issue 33).

Every parser is fed the inputs its author did not think of: random text, valid inputs with a few characters
replaced, inserted or removed, files cut at any byte, invalid UTF-8, huge numbers, NaN and infinity, duplicated
keys, very deep nesting and very long lines. The outcome must be a valid result or one ProbeError of one line; through
the CLI, exit 0 or one `error:` line and exit 2, never a traceback.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from conftest import run_cli
from probe.errors import ProbeError

MISSING_MODEL = "/nonexistent/fuzz-model.py:model"
"""A model spec that fails to load in one line: where a parser runs before the model is loaded, a valid input ends
in this error, an invalid one in the parser's."""

SPICE = ["", "0", "1", "9", "-", "--", ".", "..", ",", ",,", "*", " ", "\t", "\n", "\r", "\x00", "\x7f", "²", "١",
         "½", "nan", "NaN", "inf", "-inf", "Infinity", "1e309", "-0", "+1", "1_0", "0x1f", "9" * 5000, "enc", "dec",
         "x", "all", "ALL", "=", "==", ":", "::", "/", "\\", "%", "{", "}", "[", "]", '"', "'", "#", "_",
         "\ufeff", "\u200b", "\u2028", "é", "\U0001f600", "\udc80", "x" * 100_000]
"""Characters and pieces that parsers tend to trip on: separators, unicode digits (`²` passes str.isdigit but not
int), control characters, a lone surrogate, numbers too big for int(), very long runs."""

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-10**30, 10**30),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                    st.sampled_from(["", "x" * 100_000, "1", "0.5", "nan", "\x00"]))
JSON_VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)


@st.composite
def mutated(draw: st.DrawFn, valid: list[str]) -> str:
    """A valid input with up to four pieces replaced, inserted or cut."""
    text = draw(st.sampled_from(valid))
    for _ in range(draw(st.integers(0, 4))):
        start = draw(st.integers(0, len(text)))
        end = draw(st.integers(start, min(len(text), start + 3)))
        piece = draw(st.sampled_from(SPICE) | st.text(max_size=3))
        text = text[:start] + piece + text[end:]
    return text


def inputs(valid: list[str]) -> st.SearchStrategy[str]:
    """Random text, valid inputs as they are, and mutated ones."""
    return st.one_of(st.text(), st.sampled_from(valid), mutated(valid), st.sampled_from(SPICE))


@st.composite
def json_variant(draw: st.DrawFn, rows: list[dict[str, Any]]) -> str:
    """One JSON line made from a valid row: a key dropped, retyped, duplicated or added, the row nested too deep, a
    number too big, not an object at all, or its text mutated."""
    row = dict(draw(st.sampled_from(rows)))
    key = draw(st.sampled_from(sorted(row)))
    kind = draw(st.sampled_from(["drop", "retype", "duplicate", "extra", "deep", "huge", "mutate", "other"]))
    if kind == "drop":
        del row[key]
    elif kind == "retype":
        row[key] = draw(JSON_VALUES)
    elif kind == "extra":
        row[draw(st.text(max_size=10))] = draw(JSON_VALUES)
    line = json.dumps(row)
    if kind == "duplicate":
        return "{" + f"{json.dumps(key)}: {json.dumps(draw(JSON_VALUES))}, " + line[1:]
    if kind == "deep":
        depth = draw(st.sampled_from([50, 2_000, 100_000]))
        return line[:-1] + f', {json.dumps(key)}: ' + "[" * depth + "]" * depth + "}"
    if kind == "huge":
        return line[:-1] + f', {json.dumps(key)}: ' + draw(st.sampled_from(["9" * 5000, "1e400", "-1e400", "NaN",
                                                                              "Infinity", "1" * 20])) + "}"
    if kind == "mutate":
        return draw(mutated([line]))
    return json.dumps(draw(JSON_VALUES)) if kind == "other" else line


@st.composite
def file_bytes(draw: st.DrawFn, lines: st.SearchStrategy[str], max_lines: int = 6) -> bytes:
    """A file of lines, then damaged: cut at any byte, invalid UTF-8 inserted, a BOM put first, or random bytes."""
    chosen = draw(st.lists(lines, max_size=max_lines))
    text = draw(st.sampled_from(["\n", "\r\n", "\n\n"])).join(chosen) + draw(st.sampled_from(["", "\n"]))
    data = text.encode("utf-8", "surrogatepass")
    how = draw(st.sampled_from(["whole", "whole", "cut", "bytes", "bom", "random"]))
    if how == "cut":
        data = data[:draw(st.integers(0, len(data)))]
    elif how == "bytes":
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00", b"\x80\x80"])) + data[at:]
    elif how == "bom":
        data = b"\xef\xbb\xbf" + data
    elif how == "random":
        data = draw(st.binary(max_size=300))
    return data


def valid_or_refused(call: Callable[[], Any]) -> Any:
    """`call()`'s result, or the ProbeError it raised, whose message must be one line; anything else fails."""
    try:
        return call()
    except ProbeError as error:
        message = str(error)
        assert message.strip() and "\n" not in message.strip() and "\r" not in message, repr(message)
        return error


def cli_outcome(args: list[str], capsys: Any, monkeypatch: Any) -> tuple[int, str]:
    """Run `probe ARGS` in-process: exit 0, or exit 2 with one `error:` line and no traceback. (exit code, stderr)"""
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert "Traceback" not in err, err
    if code != 0:
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert code == 2 and len(errors) == 1, (code, err[-2000:])
    return code, err


def argument(text: str) -> str:
    """Text as one command-line argument can hold it: no NUL (the OS cannot pass one; a lone surrogate stays, as
    Python decodes bytes that are not UTF-8 in argv)."""
    return text.replace("\x00", "")


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path

"""Reading what the user names, where Python's own answers raise instead of saying no (`Path.is_file()` on a name
too long, `json.loads` on text nested too deep or an integer of 4300 digits): every such input then ends in its
reader's one-line ProbeError (found by tests/test_fuzz.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def is_file(path: str | Path) -> bool:
    """Whether `path` names a file that exists: False for a name the file system refuses (too long, NUL)."""
    try:
        return Path(path).is_file()
    except (OSError, ValueError):
        return False


def exists(path: str | Path) -> bool:
    """Whether anything exists at `path`: False for a name the file system refuses."""
    try:
        return Path(path).exists()
    except (OSError, ValueError):
        return False


class _KeyTwice(ValueError):
    pass


def _distinct_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise _KeyTwice(f"the key {key!r} is given twice")
        seen.add(key)
    return dict(pairs)


def loads(text: str) -> Any:
    """`json.loads(text)`, every failure a JSONDecodeError, a key given twice included (json keeps the last)."""
    try:
        return json.loads(text, object_pairs_hook=_distinct_keys)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", text, 0) from None
    except _KeyTwice as error:
        raise json.JSONDecodeError(str(error), text, 0) from None
    except ValueError:  # an integer of more than sys.get_int_max_str_digits() digits
        raise json.JSONDecodeError("a number too long to read", text, 0) from None

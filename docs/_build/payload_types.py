"""probe/schemas/payloads.py, generated from the registry (probe.schemas SCHEMAS): a TypedDict per published kind's
payload and per object nested in it, so that a report names the fields its kind declares and the type checker holds
it to them. `python docs/_build/generate.py` rewrites it with every other generated file, and tests/test_generated.py
fails while it differs from the registry.

A JSON number is a `float` here (what `to_dict()` holds; a file read back holds null where it was not finite); an
object whose fields are named by a pattern is a `dict`; an array without declared items a `list[Any]`.
"""

from __future__ import annotations

import keyword
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "probe" / "schemas" / "payloads.py"
PRIMITIVE = {"string": "str", "integer": "int", "number": "float", "boolean": "bool", "null": "None"}
HEAD = '''"""The payload of each published kind as a TypedDict (`to_dict()`, or its JSON file read back), generated from the
kinds' declarations by docs/_build/payload_types.py (`python docs/_build/generate.py`): never edit it by hand. Reports
name these types for the type checker only (`if TYPE_CHECKING:`), so that a field read by a report is a field its
kind declares."""

from __future__ import annotations

import sys
from typing import Any

if sys.version_info >= (3, 11):
    from typing import NotRequired, TypedDict
else:
    from typing_extensions import NotRequired, TypedDict


class Header(TypedDict):
    """What a file of any kind starts with (a payload from `to_dict()` has none of it)."""

    schema: NotRequired[str]
    schema_version: NotRequired[int]
    provenance: NotRequired[dict[str, Any]]
'''


def _camel(text: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in re.split(r"[^A-Za-z0-9]+", text) if part)


class _Writer:
    """The TypedDicts of every kind, nested ones first."""

    def __init__(self, schemas: Any) -> None:
        self.schemas = schemas
        self.blocks: list[str] = []
        self.seen: dict[tuple[str | tuple[str, str], ...], str] = {}  # an object's keys and types -> its first name

    def kind(self, name: str) -> str:
        kind = self.schemas[name]
        type_name = f"{_camel(name)}Payload"
        self.emit(type_name, self.keys(type_name, kind.fields), base="Header")
        return type_name

    def keys(self, owner: str, fields: dict[str, Any]) -> dict[str, str]:
        out = {}
        for key, field in fields.items():
            annotation = self.type(owner + _camel(key), field)
            out[key] = annotation if field.required else f"NotRequired[{annotation}]"
        return out

    def type(self, name: str, field: Any) -> str:
        if field.ref is not None:
            return f"{_camel(field.ref)}Payload"
        kinds = [field.type] if isinstance(field.type, str) else list(field.type)
        return " | ".join(self.one(name, kind, field) for kind in kinds)

    def one(self, name: str, kind: str, field: Any) -> str:
        if kind == "array":
            return f"list[{self.type(name + 'Item', field.items) if field.items is not None else 'Any'}]"
        if kind != "object":
            return PRIMITIVE[kind]
        if field.fields and not field.patterns:
            return self.emit(name, self.keys(name, field.fields))
        if field.patterns and not field.fields and len(field.patterns) == 1:
            return f"dict[str, {self.type(name + 'Value', next(iter(field.patterns.values())))}]"
        return "dict[str, Any]"

    def emit(self, name: str, keys: dict[str, str], base: str = "TypedDict") -> str:
        """Declare `name` (an alias of the first TypedDict of the same keys); the name to use for it."""
        first = self.seen.setdefault((base, *keys.items()), name)
        if first != name:  # the same object under another name: one declaration
            self.blocks.append(f"{name} = {first}\n")
            return first
        if all(key.isidentifier() and not keyword.iskeyword(key) for key in keys):
            lines = [f"class {name}({base}):"] + [f"    {key}: {annotation}" for key, annotation in keys.items()]
            self.blocks.append("\n".join(lines) + "\n")
        else:  # a key Python cannot name (no kind has one so far)
            assert base == "TypedDict", name
            lines = [f'{name} = TypedDict("{name}", {{'] + [f'    "{key}": {value},' for key, value in keys.items()]
            self.blocks.append("\n".join(lines) + "\n})\n")
        return name


def generated(text: str) -> str:
    """The whole of probe/schemas/payloads.py (`text`, its present content, is not read)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from probe.schemas import SCHEMAS

    writer = _Writer(SCHEMAS)
    for name in sorted(SCHEMAS):
        writer.kind(name)
    return HEAD + "\n\n" + "\n\n".join(writer.blocks)


if __name__ == "__main__":
    PAGE.write_text(generated(""), encoding="utf-8")

"""docs/schemas.md's list of the published schemas, generated from the registry (probe.schemas SCHEMAS): each kind,
its version, its fields and its `to_frame()` columns, between `<!-- schemas -->` and `<!-- /schemas -->`.
`python docs/_build/generate.py` rewrites it with every other generated file, and tests/test_generated.py fails while
the page differs from the registry.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "schemas.md"
REGION = re.compile(r"(<!-- schemas -->\n)(.*?)(<!-- /schemas -->)", re.DOTALL)


def _type(field: Any) -> str:
    types = [field.type] if isinstance(field.type, str) else list(field.type)
    if field.ref is not None:
        return f"object ({field.ref})"
    if "number" in types and "null" not in types:
        types.append("null")
    return " or ".join(types)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _rows(fields: dict[str, Any], patterns: dict[str, Any], what: str = "field") -> list[str]:
    rows = [f"| {what} | type | required | meaning |", "| --- | --- | --- | --- |"]
    rows += [f"| `{name}` | {_type(field)} | {'yes' if field.required else 'no'} | {_cell(field.description)} |"
             for name, field in fields.items()]
    rows += [f"| *others* | {_type(field)} | no | {_cell(field.description)} |" for field in patterns.values()]
    return rows


def section(kind: Any) -> str:
    """One kind: what it is, where it comes from, its fields and its frame's columns."""
    module, name = kind.result.split(":")
    lines = [f"## {kind.name} (v{kind.version})", "", kind.description, "",
             f"`\"schema\": \"probe/{kind.name}\"`, `\"schema_version\": {kind.version}`; the payload of "
             f"`{module}.{name}.to_dict()`; `probe schema {kind.name}` prints the schema (`$id` `{kind.id}`).", "",
             *_rows(kind.fields, kind.patterns), "",
             f"`{name}.to_frame()`: {kind.rows}.", "", *_rows(kind.columns, kind.column_patterns, "column"), ""]
    return "\n".join(lines) + "\n"


def generated(text: str) -> str:
    """`text` (docs/schemas.md) with its region rewritten from the registry."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from probe.schemas import SCHEMAS

    body = "\n".join(section(kind) for _, kind in sorted(SCHEMAS.items()))
    return REGION.sub(lambda match: match.group(1) + "\n" + body + match.group(3), text)


if __name__ == "__main__":
    PAGE.write_text(generated(PAGE.read_text(encoding="utf-8")), encoding="utf-8")

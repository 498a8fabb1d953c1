"""What a published schema is made of: a `Kind` declares its fields once, and its JSON Schema and `to_frame()`
columns are built from that. A version goes up when a field is removed, renamed or changes meaning."""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from probe.errors import ProbeError

DRAFT = "https://json-schema.org/draft/2020-12/schema"
NUMBER_NOTE = " (null where it was not finite: strict JSON has no NaN or infinity)"


@dataclass(frozen=True)
class Field:
    """One field of a payload: its JSON type(s) and meaning; `items`, `fields`, `patterns` (fields named by a regular
    expression), `ref` (another kind's payload, nested). "number" also admits null."""

    type: str | tuple[str, ...]
    description: str
    required: bool = True
    items: Field | None = None
    fields: dict[str, Field] | None = None
    patterns: dict[str, Field] | None = None
    ref: str | None = None

    def schema(self) -> dict[str, Any]:
        """This field as a JSON Schema."""
        if self.ref is not None:
            nested = SCHEMAS[self.ref]
            return {**object_schema(nested.fields, nested.patterns), "description": self.description}
        types = [self.type] if isinstance(self.type, str) else list(self.type)
        if "number" in types and "null" not in types:
            types.append("null")
        note = NUMBER_NOTE if "number" in types else ""
        out: dict[str, Any] = {"type": types[0] if len(types) == 1 else types, "description": self.description + note}
        if self.items is not None:
            out["items"] = self.items.schema()
        if self.fields is not None or self.patterns is not None:  # a closed object ("null" kept where admitted)
            out = {**object_schema(self.fields or {}, self.patterns or {}), "type": out["type"],
                   "description": out["description"]}
        return out


def object_schema(fields: dict[str, Field], patterns: dict[str, Field] | None = None) -> dict[str, Any]:
    """A closed object: these fields (the required ones required), fields matching `patterns`, nothing else."""
    out: dict[str, Any] = {"type": "object", "properties": {name: item.schema() for name, item in fields.items()},
                           "required": [name for name, item in fields.items() if item.required],
                           "additionalProperties": False}
    if patterns:
        out["patternProperties"] = {pattern: item.schema() for pattern, item in patterns.items()}
    return out


@dataclass(frozen=True)
class Kind:
    """A result kind probe writes as JSON: name, version, result class, fields, its frame's rows and columns."""

    name: str
    version: int
    result: str
    description: str
    fields: dict[str, Field]
    rows: str
    columns: dict[str, Field]
    patterns: dict[str, Field] = field(default_factory=dict)
    column_patterns: dict[str, Field] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"urn:probe-heads:schema:{self.name}:{self.version}"

    def header(self) -> dict[str, Any]:
        """The two keys every file of this kind starts with."""
        return {"schema": f"probe/{self.name}", "schema_version": self.version}

    def schema(self) -> dict[str, Any]:
        """The JSON Schema of a file of this kind; `$defs.frame_row` is one row of `to_frame()`."""
        header = {"schema": Field("string", "the kind of this file: probe/KIND (`probe schema KIND` prints its "
                                  "schema)"),
                  "schema_version": Field("integer", "the version of that schema"),
                  "provenance": Field("object", "what produced the file: versions, the model and its hash, dtype, "
                                      "device, command line, seed, time (probe/provenance.py)", required=False)}
        body = object_schema({**header, **self.fields}, self.patterns)
        body["properties"]["schema"]["const"] = f"probe/{self.name}"
        body["properties"]["schema_version"]["const"] = self.version
        row = object_schema(self.columns, self.column_patterns)
        row["description"] = f"one row of {self.result.split(':')[1]}.to_frame(): {self.rows}"
        return {"$schema": DRAFT, "$id": self.id, "title": f"probe {self.name}", "description": self.description,
                **body, "$defs": {"frame_row": row}}


DECLARED = (
    "probe.heads.classify:Classification",
    "probe.ablation.results:AblationResult",
    "probe.dla:Attribution",
    "probe.patching.heads:PatchResult",
    "probe.kv.result:KVHeads",
    "probe.kv.result:KVBudget",
    "probe.headvis.result:HeadVisMetrics",
    "probe.selfrepair:SelfRepair",
    "probe.ablation.prune:PruneResult",
    "probe.syntax.result:SyntaxResult",
    "probe.circuits.pairs:Circuits",
    "probe.qk:QKAttribution",
    "probe.headmaps.compare:Comparison",
    "probe.track.result:TrackResult",
    "probe.atlas.result:Atlas",
    "probe.steering:SteerResult",
    "probe.patterns:Patterns",
)
"""The result classes that declare their kind (`module:Class`, probe.schemas.declare), imported when first read."""


class Registry(Mapping[str, Kind]):
    """The published kinds by name, imported when first read (a result's module imports the declarations)."""

    @cached_property
    def _kinds(self) -> dict[str, Kind]:
        kinds: dict[str, Kind] = {}
        for path in DECLARED:
            module, name = path.split(":")
            kind = getattr(importlib.import_module(module), name).__kind__
            assert isinstance(kind, Kind)
            if kind.name in kinds:  # a mistake in the code, not input
                raise ValueError(f"schema kind {kind.name!r} is registered twice")
            kinds[kind.name] = kind
        return kinds

    def __getitem__(self, name: str) -> Kind:
        return self._kinds[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._kinds)

    def __len__(self) -> int:
        return len(self._kinds)


SCHEMAS = Registry()  # every kind DECLARED lists


def kind_of(name: str) -> Kind:
    """The registered kind `name`; ProbeError naming the kinds there are."""
    if name not in SCHEMAS:
        raise ProbeError(f"no schema kind {name!r}: choose one of {', '.join(sorted(SCHEMAS))}", parameter="kind")
    return SCHEMAS[name]


def header(name: str) -> dict[str, Any]:
    """`{"schema": "probe/NAME", "schema_version": N}`: what a file of kind `name` starts with."""
    return kind_of(name).header()

"""A result declared once (probe.schemas.declare): the payload, its JSON Schema and the frame's columns all come from
the class' declarations; a payload written from the class validates against the schema made from it."""

from __future__ import annotations

import json

import jsonschema
import pytest

from probe.schemas import SCHEMAS, Field
from probe.schemas.common import HEAD, LAYER
from probe.schemas.declare import Payload, columns, declarations, declared_kind, payload, published, schema_field


class Entry(Payload, frozen=True):
    layer: int = schema_field(LAYER)
    head: int = schema_field(HEAD)
    value: float | None = schema_field("a value (null: none)", column="the value")


@published("toy", 3, "A toy kind.", rows="one per entry", columns=columns({"name": Field("string", "a name")}, Entry))
class Toy(Payload):
    model: str = schema_field("the model")
    note: str = schema_field("a note", required=False, default="", kw_only=True)
    seconds: float | None = schema_field("wall time", required=False, omit="none", dump=lambda x: round(x, 1),
                                         default=None, kw_only=True)
    hidden: list[int]

    @payload("every entry", key="entries", items="an entry")
    def entry_list(self) -> list[Entry]:
        return [Entry(0, head, None if value < 0 else value) for head, value in enumerate(self.hidden)]

    sizes: dict[str, int] = schema_field("sizes", default_factory=dict)


def test_the_payload_follows_the_declarations_in_order_optional_fields_left_out() -> None:
    toy = Toy("m", [3, -1], {"a": 1}, seconds=0.0)
    assert json.dumps(toy.to_dict()) == json.dumps({
        "model": "m", "seconds": 0.0, "entries": [{"layer": 0, "head": 0, "value": 3}, {"layer": 0, "head": 1,
                                                                                        "value": None}],
        "sizes": {"a": 1}})
    assert Toy("m", [], note="n", seconds=1.26).to_dict() == {"model": "m", "note": "n", "seconds": 1.3,
                                                              "entries": [], "sizes": {}}
    assert [item.key for item in declarations(Toy)] == ["model", "note", "seconds", "entries", "sizes"]


def test_the_schema_types_come_from_the_annotations_and_validate_the_payload() -> None:
    declared = declared_kind(Toy)
    assert "toy" not in SCHEMAS and declared.result == f"{__name__}:Toy"
    schema = declared.schema()
    properties = schema["properties"]
    assert properties["model"]["type"] == "string" and properties["sizes"]["type"] == "object"
    assert properties["note"]["type"] == "string" and "note" not in schema["required"]
    entry = properties["entries"]["items"]
    assert entry["description"] == "an entry" and entry["required"] == ["layer", "head", "value"]
    assert entry["properties"]["value"]["type"] == ["number", "null"]
    check = jsonschema.Draft202012Validator(schema)
    good = {"schema": "probe/toy", "schema_version": 3, **Toy("m", [1, -2], seconds=2.0).to_dict()}
    check.validate(good)
    assert not check.is_valid({**good, "undeclared": 1})
    assert list(schema["$defs"]["frame_row"]["properties"]) == ["name", "value"]
    assert schema["$defs"]["frame_row"]["properties"]["value"]["description"].startswith("the value")


def test_a_field_whose_annotation_says_no_json_type_must_name_one() -> None:
    with pytest.raises(TypeError, match="no JSON type: pass type="):
        class Vague(Payload):
            anything: object = schema_field("anything")


def test_every_declared_result_is_its_kind_in_the_registry() -> None:
    """Each class DECLARED lists is a Payload whose kind the registry holds as it is (name, class path), and its
    to_dict is the generated one."""
    import importlib

    from probe.schemas.kinds import DECLARED

    for path in DECLARED:
        module, name = path.split(":")
        cls = getattr(importlib.import_module(module), name)
        assert issubclass(cls, Payload) and cls.to_dict is Payload.to_dict, path
        declared = declared_kind(cls)
        assert SCHEMAS[declared.name] is declared and declared.result == path


def test_frame_rows_are_the_declared_columns() -> None:
    """record_rows: a head's three columns, then each field declared a column (a list joined by commas; an optional
    one left out where None)."""
    from probe.frames import record_rows
    from probe.patching.heads import PatchHead

    rows = record_rows([PatchHead(1, 2, 0.5, None, 1.5, ["sink", "induction"]), PatchHead(0, 1, 0.1, 0.2, 1.0)])
    assert rows == [{"layer": 1, "head": 2, "name": "L1H2", "patch_effect": 0.5, "dla": None, "logit_diff": 1.5,
                     "classes": "sink,induction"},
                    {"layer": 0, "head": 1, "name": "L0H1", "patch_effect": 0.1, "dla": 0.2, "logit_diff": 1.0}]

"""A result declared once (probe.schemas.declare): the payload, its JSON Schema and the frame's columns all come from
the class' declarations; a payload written from the class validates against the schema made from it."""

from __future__ import annotations

import dataclasses
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

    from probe.schemas.base import DECLARED

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


class Measured(Payload):
    """A nested record spread into its parent's entry: its fields, then fields named by a pattern."""

    loss: float = schema_field("the loss")
    parts: dict[str, float] = dataclasses.field(default_factory=dict)

    @payload("each part's loss", spread=True, patterns={r"^part_": Field("number", "a part's loss")})
    def part_losses(self) -> dict[str, float]:
        return {f"part_{name}": value for name, value in self.parts.items()}


class Row(Payload, frozen=True):
    layer: int = schema_field(LAYER)
    measured: Measured = schema_field("what was measured", spread=True)
    note: str = schema_field("a note", required=False, default="")


@published("nested-toy", 1, "A toy kind with nested entries.", rows="one per row", columns={})
class Nested(Payload):
    rows: list[Row] = schema_field("every row", items="a row")
    size: int = schema_field("a size", default=0)

    @payload("the run's dtype")
    def dtype(self) -> str:
        return "bfloat16" if self.size else "float32"

    @payload("the largest loss", dump=lambda loss: round(loss, 2))
    def largest(self) -> float:
        return max((row.measured.loss for row in self.rows), default=0.0)


def test_a_payload_value_is_a_property_its_key_and_schema_as_declared() -> None:
    """`@payload` makes a property: `result.dtype` is the value (no bound method), read-only, typed by its
    annotation in the schema, its payload key the attribute's name; `dump` writes it as the payload holds it."""
    nested = Nested([Row(0, Measured(1.234))], size=2)
    assert nested.dtype == "bfloat16" and Nested([]).dtype == "float32"
    assert isinstance(Nested.__dict__["dtype"], property)
    with pytest.raises(AttributeError):
        nested.dtype = "float16"  # type: ignore[misc]
    assert nested.largest == 1.234 and nested.to_dict()["largest"] == 1.23
    assert list(nested.to_dict()) == ["rows", "size", "dtype", "largest"] and nested.to_dict()["dtype"] == "bfloat16"
    properties = declared_kind(Nested).schema()["properties"]
    assert properties["dtype"]["type"] == "string" and properties["largest"]["type"] == ["number", "null"]


def test_the_dtype_of_a_comparison_and_an_atlas_reads_as_an_attribute() -> None:
    """Comparison.dtype (and Atlas.dtype) are the values their payloads hold under `dtype`."""
    import numpy as np

    from probe.headmaps.compare import compare
    from probe.headmaps.maps import QUERY, HeadMap

    values = np.random.default_rng(0).random((4, 6))
    same = compare(*(HeadMap(values, QUERY, name, "tensor", "value", dtype="bfloat16") for name in "ab"), top_k=5,
                   same_kind=True)
    other = compare(HeadMap(values, QUERY, "a", "tensor", "value", dtype="bfloat16"),
                    HeadMap(values, QUERY, "b", "tensor", "value", dtype="float32"), top_k=5, same_kind=True)
    assert same.dtype == "bfloat16" == same.to_dict()["dtype"] and other.dtype is None
    from probe.atlas.result import Atlas

    assert "dtype" in [item.key for item in declarations(Atlas)] and isinstance(Atlas.__dict__["dtype"], property)


def test_a_nested_entry_is_declared_once_its_schema_derived_from_its_class() -> None:
    """An array of nested Payloads takes its items' schema from their class; a field declared `spread=True` merges
    the nested record's fields (and patterns) in at its place, in the payload and in the schema."""
    nested = Nested([Row(1, Measured(0.5, {"a": 0.25}), note="n"), Row(2, Measured(0.75))])
    assert json.dumps(nested.to_dict()["rows"]) == json.dumps([
        {"layer": 1, "loss": 0.5, "part_a": 0.25, "note": "n"}, {"layer": 2, "loss": 0.75}])
    schema = declared_kind(Nested).schema()
    item = schema["properties"]["rows"]["items"]
    assert item["description"] == "a row" and list(item["properties"]) == ["layer", "loss", "note"]
    assert item["required"] == ["layer", "loss"] and list(item["patternProperties"]) == ["^part_"]
    check = jsonschema.Draft202012Validator(schema)
    good = {"schema": "probe/nested-toy", "schema_version": 1, **nested.to_dict()}
    check.validate(good)
    broken = json.loads(json.dumps(good))
    broken["rows"][0]["los"] = broken["rows"][0].pop("loss")
    assert not check.is_valid(broken)


def test_an_ablation_entry_is_its_head_then_what_was_measured() -> None:
    """HeadResult's entries (a head's, a group's) are declared: the payload's keys in the written order, the ablate
    schema's items the entry classes' fields, and `from_dict` reads an entry back."""
    from probe.ablation.results import GroupEntry, HeadEntry, HeadResult

    single = HeadResult(((1, 2),), 2.5, 0.5, {"second_repeat": 3.0}, {"second_repeat": 1.0}, True,
                        {"mean_delta": 0.1}, {"margin": 0.2})
    assert list(single.to_dict()) == ["layer", "head", "loss", "delta", "second_repeat_loss", "second_repeat_delta",
                                      "exact", "task_margin", "effects"]
    assert HeadEntry.of(single, (0.25, 0.5)).to_dict() == {**single.to_dict(), "first_order": 0.25,
                                                           "second_order": 0.5}
    group = HeadResult(((0, 1), (1, 2)), 3.0, 1.0)
    assert group.to_dict() == {"heads": [[0, 1], [1, 2]], "label": "0.1+1.2", "loss": 3.0, "delta": 1.0}
    assert HeadResult.from_dict(single.to_dict()) == single and HeadResult.from_dict(group.to_dict()) == group
    items = SCHEMAS["ablate"].schema()["properties"]
    assert list(items["heads"]["items"]["properties"]) == ["layer", "head", "loss", "delta", "exact", "effects",
                                                           "first_order", "second_order"]
    assert list(items["groups"]["items"]["properties"])[:2] == ["heads", "label"]
    assert [item.key for item in declarations(GroupEntry)][:2] == ["heads", "label"]

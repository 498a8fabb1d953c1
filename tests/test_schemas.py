"""The published schemas (probe/schemas/, docs/schemas.md): every command's --json file validates against its kind's
schema, the schema refuses a payload with a field missing or misspelt, `probe schema` prints each, and every result's
`to_frame()` has the columns its schema documents, and the file holds its result's `to_dict()` as it is. Adding a
kind: its result class declared with probe.schemas.declare (`@published`, listed in probe.schemas.base.DECLARED),
and its line in RUNS."""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from conftest import run_cli
from test_precision import COMMANDS, PLANTED, WORDS

from probe.reports.files import finite, write_json
from probe.schemas import SCHEMAS, header

ROOT = Path(__file__).resolve().parents[1]


def _budget(tmp: Path) -> list[str]:
    """kv-heads with an export, its budget calibrated (points measured: rows for the frame; a transformers model,
    which window ablation needs)."""
    return ["kv-heads", "--model", "tests/planted.py:planted_gpt2", "--lengths", "120", "--depths", "0.5", "--sink",
            "1", "--recent", "4", "--no-curve", "--export", f"razor:{tmp / 'razor.json'}"]


def _maps(tmp: Path) -> list[str]:
    """compare on two maps the test writes: a query-head .npy with a head it lacks (NaN: null values and ranks)
    against a DuoAttention KV-head map, grouped; --threshold labels both (the labelled overlap is written)."""
    import numpy as np

    query = np.random.default_rng(0).random((3, 8))
    query[1, 2] = np.nan
    np.save(tmp / "query.npy", query)
    (tmp / "duo").mkdir()
    (tmp / "duo" / "full_attention_heads.tsv").write_text(
        "".join("\t".join(f"{value:.6f}" for value in row) + "\n" for row in np.random.default_rng(1).random((3, 2))),
        encoding="utf-8")
    return ["compare", str(tmp / "query.npy"), str(tmp / "duo"), "--group", "max", "--threshold", "0.5"]


RUNS: dict[str, tuple[Any, str]] = {
    **{name: (args, "") for name, args in COMMANDS.items() if name in SCHEMAS},  # kinds, not variants of one
    "circuits": (lambda tmp: ["circuits", "--model", PLANTED, "--seq-len", "64", "--num-seqs", "4", "--repeat-len",
                              "20"], ""),  # induction heads to list
    "steer": (lambda tmp: ["steer", "--model", WORDS, "--heads", "1.2,0.1", "--alpha", "0,2", "--task", "ioi",
                           "--num-seqs", "6", "--generate", "the keys", "--max-new-tokens", "2"], ""),
    "heatmap": (lambda tmp: ["heatmap", "--model", WORDS, "--text", "the keys to the cabinet are here"], ""),
    "self-repair": (lambda tmp: ["patch", "--model", WORDS, "--task", "ioi", "--count", "6", "--heads", "0.1,1.2",
                                 "--self-repair"], "self_repair"),
    "kv-budget": (_budget, "razor.budget.json"),
    "compare": (_maps, ""),
    "qk": (lambda tmp: ["qk", "--model", "tests/planted.py:planted_gpt2", "--head", "1.1", "--at", "induction",
                        "--num-seqs", "2", "--repeat-len", "8"], ""),
}
"""Per kind: the command that writes it (--json added) and where its payload is: "" the --json file itself, a key
of it (a section), or a file written beside it."""
RESULTS = set(SCHEMAS) - {"compare"}  # compare reads two maps: its dtype is theirs, null where they differ


def validator(kind: str) -> jsonschema.Draft202012Validator:
    schema = SCHEMAS[kind].schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def result_class(kind: str) -> type:
    module, name = SCHEMAS[kind].result.split(":")
    return getattr(importlib.import_module(module), name)


def run_kind(kind: str, tmp_path: Path, capsys, monkeypatch) -> tuple[dict[str, Any], Any]:
    """Run the kind's command; its payload as written, and the result object whose to_dict() made it."""
    import probe.inputs.contrast as contrast

    monkeypatch.setattr(contrast, "MIN_GAP", 1e-4)  # a random tiny model's corruption changes little
    cls, made = result_class(kind), []
    own = cls.to_dict

    def recording(self, *args, **kwargs):
        made.append(self)
        return own(self, *args, **kwargs)

    monkeypatch.setattr(cls, "to_dict", recording)
    args, where = RUNS[kind]
    path = tmp_path / "out.json"
    code, _, err = run_cli([*args(tmp_path), "--json", str(path)], capsys, monkeypatch)
    assert code == 0, err
    payload = json.loads(path.read_text(encoding="utf-8"))
    if where.endswith(".json"):
        payload = json.loads((tmp_path / where).read_text(encoding="utf-8"))
    elif where:
        payload = {**header(kind), **payload[where]}  # a section: its kind's payload, nested
    assert made, f"{cls.__name__}.to_dict() was not called by the command"
    return payload, made[-1]


def test_every_kind_has_a_run_here() -> None:
    assert set(RUNS) == set(SCHEMAS)


def test_every_result_declares_the_dtype_it_was_computed_in() -> None:
    """docs/precision.md: every result's payload has a `dtype` (a string, required) besides provenance's."""
    for kind in RESULTS:
        field = SCHEMAS[kind].fields.get("dtype")
        assert field is not None and field.type == "string" and field.required, kind


@pytest.mark.parametrize("kind", sorted(SCHEMAS))
def test_the_file_validates_its_schema_refuses_a_broken_one_and_the_frame_has_its_columns(
        kind: str, tmp_path: Path, capsys, monkeypatch) -> None:
    payload, result = run_kind(kind, tmp_path, capsys, monkeypatch)
    check = validator(kind)
    if not RUNS[kind][1]:
        assert list(payload)[:2] == ["schema", "schema_version"] and "provenance" in payload
    assert payload["schema"] == f"probe/{kind}" and payload["schema_version"] == SCHEMAS[kind].version
    check.validate(payload)
    if kind in RESULTS:  # every result records the dtype it was computed in: these runs' default, float32
        assert payload["dtype"] == "float32"
    required = next(name for name, field in SCHEMAS[kind].fields.items() if field.required)
    for broken in ({key: value for key, value in payload.items() if key != required},
                   {(key + "s" if key == required else key): value for key, value in payload.items()},
                   {**payload, "schema_version": SCHEMAS[kind].version + 1}):
        assert not check.is_valid(broken)
    frame_columns(kind, result)
    written_as_declared(payload, result)


def written_as_declared(payload: dict[str, Any], result: Any) -> None:
    """The file holds the result's own `to_dict()` (made from its declarations), nothing added, dropped or
    reordered: a field declared but not written, or written but not declared, fails here."""
    written = {key: value for key, value in payload.items() if key not in ("schema", "schema_version", "provenance")}
    declared = json.loads(json.dumps(finite(result.to_dict()), allow_nan=False))
    assert list(written) == list(declared) and written == declared


def frame_columns(kind: str, result: Any) -> None:
    """The frame's columns are the documented ones (the required ones present, no other), every row valid."""
    frame = result.to_frame()
    assert len(frame) > 0, f"{kind}: an empty frame proves nothing"
    entry = SCHEMAS[kind]
    columns = list(frame.columns)
    assert {name for name, field in entry.columns.items() if field.required} <= set(columns)
    undocumented = [name for name in columns if name not in entry.columns and
                    not any(re.search(pattern, name) for pattern in entry.column_patterns)]
    assert not undocumented, f"{kind}: to_frame() columns missing from its schema: {undocumented}"
    if list(entry.columns)[:3] == ["layer", "head", "name"]:  # a head's columns first
        assert columns[:3] == ["layer", "head", "name"]
    row_check = jsonschema.Draft202012Validator({**SCHEMAS[kind].schema()["$defs"]["frame_row"]})
    for row in json.loads(frame.to_json(orient="records")):  # NaN as null, numpy numbers as JSON's
        row_check.validate(row)


@pytest.mark.parametrize("kind", sorted(SCHEMAS))
def test_probe_schema_prints_each(kind: str, capsys, monkeypatch) -> None:
    code, out, err = run_cli(["schema", kind], capsys, monkeypatch)
    assert code == 0, err
    printed = json.loads(out)
    assert printed == SCHEMAS[kind].schema()
    assert printed["$id"] == f"urn:probe-heads:schema:{kind}:{SCHEMAS[kind].version}"
    jsonschema.Draft202012Validator.check_schema(printed)


def test_probe_schema_lists_the_kinds_and_refuses_an_unknown_one(capsys, monkeypatch) -> None:
    code, out, _ = run_cli(["schema"], capsys, monkeypatch)
    assert code == 0
    listed = {line.split()[0]: line.split()[1] for line in out.splitlines()}
    assert listed == {name: f"v{entry.version}" for name, entry in SCHEMAS.items()}
    code, out, err = run_cli(["schema", "clasify"], capsys, monkeypatch)
    assert code != 0 and out == "" and len(err.strip().splitlines()) == 1
    assert "'clasify'" in err and all(name in err for name in SCHEMAS)


def test_a_json_file_must_name_its_schema(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="names its schema"):
        write_json(tmp_path / "a.json", {"a": 1}, schema=None)
    write_json(tmp_path / "b.json", {"a": 1}, schema=None, stamp=False)  # an export in another tool's format
    assert json.loads((tmp_path / "b.json").read_text()) == {"a": 1}


def test_a_field_without_a_declaration_is_refused(tmp_path: Path) -> None:
    """A field a to_dict() gains fails validation until its kind declares it (no schema admits unknown fields)."""
    payload = {**header("dla"), "model": "m"}
    errors = [error.message for error in validator("dla").iter_errors({**payload, "new_field": 1})]
    assert any("'new_field' was unexpected" in message for message in errors)


def test_the_docs_page_is_generated_from_the_registry() -> None:
    spec = importlib.util.spec_from_file_location("schema_page", ROOT / "docs" / "_build" / "schema_page.py")
    assert spec is not None and spec.loader is not None
    page = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(page)
    text = (ROOT / "docs" / "schemas.md").read_text(encoding="utf-8")
    assert text == page.generated(text), "docs/schemas.md differs from the registry: run docs/_build/schema_page.py"
    assert all(f"## {name} (v{entry.version})" in text for name, entry in SCHEMAS.items())

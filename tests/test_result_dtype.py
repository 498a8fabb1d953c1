"""Every result records the dtype it was computed in (issue 45, docs/precision.md), here the five that came last:
prune, kv-budget (the budget file beside a kv-heads export), syntax, circuits and heatmap. Run in bfloat16 on tiny
models, each file says `dtype: bfloat16` (the run's, as its provenance says) and validates against its schema, the
terminal report's last line (heatmap's: its last note) and the HTML page's facts say what it was computed in; a
payload written before results recorded a dtype still renders, without the clause."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli
from rich.console import Console
from test_schemas import RUNS, validator

from probe.cli.prune import summary
from probe.reports.circuits import circuits_page, circuits_report
from probe.reports.labels import precision_note
from probe.reports.prune import prune_page
from probe.reports.syntax import syntax_page, syntax_report

KINDS = ("prune", "kv-budget", "syntax", "circuits", "heatmap")
PAGES = {"prune", "syntax", "circuits", "heatmap"}  # the kinds whose command draws a page (--html)
CLAUSE = "computed in bfloat16, its sums in float32 or wider"


def run_in_bfloat16(kind: str, tmp_path: Path, capsys, monkeypatch) -> tuple[dict, dict, str, str]:
    """The kind's command of tests/test_schemas.py's RUNS in bfloat16 (with a page where it draws one): the file it
    wrote with --json, the kind's payload in it (or beside it), and the command's stdout and stderr."""
    args, where = RUNS[kind]
    path, page = tmp_path / "out.json", ["--html", str(tmp_path / "out.html")] if kind in PAGES else []
    code, out, err = run_cli([*args(tmp_path), "--dtype", "bfloat16", "--json", str(path), *page], capsys,
                             monkeypatch)
    assert code == 0, err
    written = json.loads(path.read_text(encoding="utf-8"))
    payload = json.loads((tmp_path / where).read_text(encoding="utf-8")) if where else written
    return written, payload, out, err


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_a_bfloat16_run_records_bfloat16_and_its_report_and_page_say_so(kind: str, tmp_path: Path, capsys,
                                                                         monkeypatch) -> None:
    written, payload, out, err = run_in_bfloat16(kind, tmp_path, capsys, monkeypatch)
    assert written["provenance"]["dtype"] == "bfloat16"
    assert payload["dtype"] == "bfloat16"
    validator(kind).validate(payload)
    if kind == "kv-budget":  # calibrated here: the budget itself says what its points were measured in
        assert payload["budget"]["dtype"] == "bfloat16" and payload["budget"]["points"]
    last = (err if kind == "heatmap" else out).strip().splitlines()[-1]
    assert CLAUSE in last.lower(), last
    if kind in PAGES:
        assert f"<td>precision</td><td>{CLAUSE}" in (tmp_path / "out.html").read_text(encoding="utf-8")


@pytest.mark.slow
def test_a_fixed_budget_records_the_run_dtype_too(tmp_path: Path, capsys, monkeypatch) -> None:
    """The budget of a fixed fraction (no point measured) states the run's dtype, in the kv-heads file and beside the
    export."""
    args = ["kv-heads", "--model", "tests/planted.py:planted_gpt2", "--lengths", "120", "--depths", "0.5", "--sink",
            "1", "--recent", "4", "--no-curve", "--full-fraction", "0.25", "--dtype", "bfloat16",
            "--export", f"razor:{tmp_path / 'razor.json'}", "--json", str(tmp_path / "out.json")]
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    payload = json.loads((tmp_path / "out.json").read_text(encoding="utf-8"))
    beside = json.loads((tmp_path / "razor.budget.json").read_text(encoding="utf-8"))
    assert payload["budget"]["rule"].startswith("fixed") and not payload["budget"]["points"]
    assert payload["dtype"] == payload["budget"]["dtype"] == beside["dtype"] == beside["budget"]["dtype"] == "bfloat16"
    validator("kv-budget").validate(beside)


def test_a_payload_written_before_results_recorded_a_dtype_still_renders(tmp_path: Path, capsys,
                                                                          monkeypatch) -> None:
    """Reports read files written before: no `dtype`, no clause, and nothing else missing."""
    renders = {"prune": (summary, prune_page), "syntax": (syntax_report, syntax_page),
               "circuits": (circuits_report, circuits_page)}
    for kind, (report, page) in renders.items():
        args, _ = RUNS[kind]
        code, _, err = run_cli([*args(tmp_path), "--json", str(tmp_path / f"{kind}.json")], capsys, monkeypatch)
        assert code == 0, err
        payload = json.loads((tmp_path / f"{kind}.json").read_text(encoding="utf-8"))
        assert payload["dtype"] == "float32" and precision_note(payload) == "computed in float32"
        older = {key: value for key, value in payload.items() if key != "dtype"}
        for given, said in ((payload, True), (older, False)):
            console = Console(record=True, width=300)
            report(given, console)
            last = console.export_text().strip().splitlines()[-1]
            assert ("computed in float32" in last.lower()) == said, (kind, last)
            assert ("<td>precision</td><td>computed in float32</td>" in page(given)) == said, kind

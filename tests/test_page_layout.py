"""Every kind of page, made by its own command on a tiny model (tests/page_kinds.py), laid out in a real headless
Chromium at 1000 and 1400 px without a fault that reports/assets/layout.js finds (the check
docs/_build/screenshots.py runs on the docs' pictures): no clipped text, no overlapping boxes (plotly's mode bar over
a plot included), no empty section, plots and tables using the width, no word broken in a header, no axis running
far past its data, no raw newline shown as a line break. And each kind has its picture in the docs."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest

import page_kinds
from probe.reports.atlas import atlas_page
from probe.reports.prune import prune_page
from test_browser import browser  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parents[1]
WIDTHS = (1000, 1400)

pytestmark = pytest.mark.browser


def _screenshots() -> Any:
    spec = importlib.util.spec_from_file_location("screenshots", ROOT / "docs" / "_build" / "screenshots.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SCREENSHOTS = _screenshots()


def _curve(ordering: str, seed: int | None, losses: list[float]) -> dict[str, Any]:
    steps = [{"step": i, "units_removed": i, "heads_removed": i, "share_pruned": round(0.02 * i, 4), "loss": loss,
              "delta": loss - 3.0, "removed": []} for i, loss in enumerate(losses)]
    return {"ordering": ordering, "seed": seed, "stopped": "limit", "kept_mask": [[1]], "steps": steps}


def early_stop_prune(folder: Path) -> Path:
    """A prune run whose every curve stops at the limit by 10% pruned (as SmolLM2's did at --max-increase 2%)."""
    payload = {"model": "m", "metric": "cross_entropy", "method": "zero", "data": "text", "units": "heads",
               "n_units": 50, "n_layers": 5, "n_heads": 10, "baseline_loss": 3.0, "step": 0.02, "max_loss": 3.06,
               "seconds": 1.0, "costs": {},
               "curves": [_curve("michel", None, [3.0, 3.0, 3.01, 3.02, 3.04, 3.05, 3.07]),
                          _curve("sweep", None, [3.0, 3.01, 3.02, 3.05, 3.08]),
                          _curve("random", 0, [3.0, 3.03, 3.07]), _curve("random", 1, [3.0, 3.02, 3.05, 3.09])]}
    path = folder / "prune-early.html"
    path.write_text(prune_page(payload), encoding="utf-8")
    return path


def newline_atlas(folder: Path) -> Path:
    """The atlas run's page with a newline and a tab in a head's most affected token's context, as natural text
    has them."""
    payload = json.loads((folder / "atlas.json").read_text(encoding="utf-8"))
    token = payload["heads"][0]["effects"]["top_tokens"][0]
    token["context"] = "the end.\n\tNext line " + token["context"]
    path = folder / "atlas-newline.html"
    path.write_text(atlas_page(payload), encoding="utf-8")
    return path


def compare_kinds(folder: Path) -> Path:
    """probe compare of two kinds of score (classify's induction scores against ablate's loss changes): compared by
    rank, with the sentence that says why, each map on its own scale."""
    small = ["--model", page_kinds.PLANTED, "--num-seqs", "2", "--repeat-len", "8"]
    path = folder / "compare-kinds.html"
    for args in (["classify", *small, "--json", str(folder / "scores.json")],
                 ["ablate", *small, "--data", "repeated", "--json", str(folder / "deltas.json")],
                 ["compare", str(folder / "scores.json"), str(folder / "deltas.json"), "--score", "induction",
                  "--score", "delta", "--html", str(path)]):
        code, err = page_kinds.run([*args, "--force"])
        assert code == 0, err
    return path


@pytest.fixture(scope="module")
def pages(command_outputs: dict[str, Path]) -> dict[str, Path]:
    folder = command_outputs["atlas"].parent  # the session's pages (tests/conftest.py), beside which the variants go
    return command_outputs | {"prune-early": early_stop_prune(folder), "atlas-newline": newline_atlas(folder),
                   "compare-kinds": compare_kinds(folder)}


def faults_of(browser: Any, path: Path, width: int, kind: str) -> list[str]:  # noqa: F811
    """The page's layout faults at `width` px (after the clicks screenshots.OPEN names), and its script errors."""
    context = browser.new_context(viewport={"width": width, "height": 900})
    try:
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(f"script error: {error}"))
        page.goto(path.resolve().as_uri())
        return SCREENSHOTS.layout_faults(page, kind) + errors
    finally:
        context.close()


KINDS = [*page_kinds.COMMANDS, "prune-early", "atlas-newline", "compare-kinds"]
OPENED_AS = {"atlas-newline": "atlas", "compare-kinds": "compare"}  # a variant laid out as its command's page


@pytest.mark.slow
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("kind", KINDS)
def test_every_page_kind_lays_out_without_a_fault(kind: str, width: int, pages, browser) -> None:  # noqa: F811
    opened = OPENED_AS.get(kind, kind)
    assert faults_of(browser, pages[kind], width, opened) == []


def test_the_check_finds_what_a_reader_would_see(tmp_path: Path, browser) -> None:  # noqa: F811
    """The check is not blind: a page with each fault planted gets a line for each."""
    from probe.reports.html import page

    body = ('<table class="probe-kv"><tr><td style="width:30px; display:inline-block">streaming</td></tr></table>'
            '<h2 style="width:40px; overflow-wrap:anywhere">notawordthatfits</h2>'
            '<div class="probe-section"><h2>Empty</h2></div>'
            '<div class="probe-section"><h2>Narrow</h2><table><tr><td>x</td></tr></table></div>'
            '<div style="white-space:pre-wrap">one\ntwo</div><p style="width:50px; overflow:hidden; '
            'white-space:nowrap">a long sentence that cannot fit</p>')
    path = tmp_path / "faulty.html"
    path.write_text(page("circuits", "faulty", body, {}, embed_plotly=True), encoding="utf-8")
    faults = "\n".join(faults_of(browser, path, 1000, "circuits"))
    for expected in ("an empty section: Empty", "plots and tables use", "a word broken inside a header",
                     "a raw newline in the text", "text wider than its box: a long sentence"):
        assert expected in faults, faults


def test_the_atlas_has_a_colour_legend_and_shows_newlines_as_symbols(pages, browser) -> None:  # noqa: F811
    """Each class's colour in the head finder is named in a legend; a newline in a token's context reads ↵."""
    payload = json.loads((pages["atlas"].parent / "atlas.json").read_text(encoding="utf-8"))
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    try:
        page = context.new_page()
        page.goto(pages["atlas-newline"].resolve().as_uri())
        SCREENSHOTS.ready(page)
        legend = page.evaluate("Array.from(document.querySelectorAll('.atlas-legend-item'))"
                               ".map(item => [item.textContent, item.dataset.colour])")
        assert [name for name, _ in legend] == [*payload["classes"], "no class"]
        colours = dict(legend)
        drawn = page.evaluate("(() => { const d = document.querySelector('.atlas-grid').data[0]; "
                              "return d.customdata.map((row, i) => [row, d.marker.color[i]]); })()")
        labelled = {f"{h['layer']}.{h['head']}": h["classes"][0]["class"] if h["classes"] else "no class"
                    for h in payload["heads"]}
        rows = page.evaluate("JSON.parse(document.getElementById('probe-page-data').textContent).rows"
                             ".map(row => row.label)")
        for index, colour in drawn:
            assert colour == colours[labelled[rows[index]]]
        assert len(set(colours.values())) == len(colours)
        page.click("tr.atlas-row")
        page.wait_for_selector(".atlas-dashboard .atlas-example b")
        text = page.text_content(".atlas-dashboard")
        assert "the end.↵⇥Next line" in text and "\n\t" not in text
    finally:
        context.close()


def test_every_page_kind_has_its_screenshot_in_the_docs() -> None:
    """docs/_build/screenshots.py takes every kind the tests lay out, and a docs page shows each picture."""
    assert set(SCREENSHOTS.PAGES) == set(page_kinds.COMMANDS)
    docs = "\n".join(path.read_text(encoding="utf-8") for path in (ROOT / "docs").glob("*.md"))
    shown = set(re.findall(r"\(images/page-([\w-]+)\.png\)", docs))
    assert shown == set(SCREENSHOTS.PAGES), sorted(shown ^ set(SCREENSHOTS.PAGES))
    for kind in SCREENSHOTS.PAGES:
        assert (ROOT / "docs" / "images" / f"page-{kind}.png").is_file(), kind
    assert sum(path.stat().st_size for path in (ROOT / "docs" / "images").iterdir()) < 5 * 2**20



def test_the_compare_page_is_titled_by_the_ends_of_its_paths(pages) -> None:
    """Two whole paths in the title would wrap inside a path at 1000 px: the title names the maps by as much of
    their paths as tells them apart, the facts under it by their whole paths."""
    from probe.reports.compare import short_names

    html = pages["compare"].read_text(encoding="utf-8")
    assert "<h1>query.npy against duo</h1>" in html and str(pages["compare"].parent / "query.npy") in html
    assert short_names("/runs/a/map.json", "/runs/b/map.json") == ("a/map.json", "b/map.json")
    assert short_names("maps/f32.json", "maps/f32.json") == ("f32.json", "f32.json")
    assert short_names("dir/m.json", "m.json") == ("dir/m.json", "m.json")

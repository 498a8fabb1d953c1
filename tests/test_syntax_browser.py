"""The syntax page in headless Chromium (fixtures of test_browser): the relation x head map draws the payload's
margins, the arc view draws a head's correct arcs over the words, text stays text, nothing is fetched."""

from __future__ import annotations

import pytest

from planted_syntax import conllu_corpus, planted_syntax
from probe.syntax import read_conllu, syntax_scores
from probe.reports.syntax import syntax_page
from test_browser import browser, open_page, screenshot  # noqa: F401 (fixtures)
from test_html import IMG, SCRIPT

pytestmark = pytest.mark.browser


@pytest.mark.slow
def test_syntax_page(tmp_path, open_page):  # noqa: F811
    corpus = tmp_path / "c.conllu"
    corpus.write_text(conllu_corpus(16), encoding="utf-8")
    payload = syntax_scores(planted_syntax(), read_conllu(corpus), scheme="ud", source=f"file {IMG}",
                            min_count=5).to_dict()
    payload["model"] = SCRIPT
    example = payload["examples"][0]
    example["words"][0] = SCRIPT  # text in the arcs view stays text
    path = tmp_path / "syntax.html"
    path.write_text(syntax_page(payload), encoding="utf-8")
    opened = open_page(path, wait=False)
    opened.wait_ready(layer="0", head="0", sentence="0")
    assert opened.page.text_content("h1") == f"Syntactic heads of {SCRIPT}"
    grid = opened.page.evaluate("document.querySelector('.probe-syntax-plot').data[0]")
    judged = [e for e in payload["relations"] if e["judged"]]
    assert len(grid["y"]) == len(judged) and len(grid["x"]) == 4
    for row, entry in zip(grid["z"], judged):
        assert row == pytest.approx([a - entry["baseline"] for layer in entry["accuracy"] for a in layer], abs=1e-4)
    words = opened.page.evaluate("Array.from(document.querySelectorAll('.probe-word')).map(t => t.textContent)")
    assert words == example["words"]
    right = opened.page.locator(".probe-arc-right").count()
    assert right == len(example["hits"][0]) == len(example["arcs"])  # the planted head gets every arc
    opened.page.select_option(".probe-syntax-head", "0,1")
    opened.wait_ready(layer="0", head="1")
    assert opened.page.locator(".probe-arc-right").count() == len(example["hits"][1])
    assert opened.page.text_content(".probe-arc-count") == f"{len(example['hits'][1])} of {len(example['arcs'])} " \
                                                          "arcs right"
    opened.page.select_option(".probe-sentence", "1")
    opened.wait_ready(layer="0", head="1", sentence="1")
    assert opened.page.locator(".probe-arc").count() == len(payload["examples"][1]["arcs"])
    assert opened.page.locator(".probe-page script").count() == 1 and opened.page.locator("svg script").count() == 0
    screenshot(opened, "syntax.png")
    opened.check_clean()

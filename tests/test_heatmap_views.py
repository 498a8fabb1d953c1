"""Heatmap views in a real Chromium: a colour scale that leaves BOS out, the repeat boundary and the diagonal an
induction / duplicate-token head should follow marked on the classify page's patterns, a token-centred view (click a
token, see its attention over the text), and token labels that stay readable at 150 tokens and follow a zoom."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from probe.heads.classify import Classification
from probe.reports.html import classification_page, heatmap_page
from test_browser import ARGS, CHROMIUM, browser  # noqa: F401  (the module's Chromium fixture)
from test_html import fake_patterns, page_data

pytestmark = pytest.mark.browser
R = 3  # repeat length of the hand-made repeated sequence: BOS + 3 tokens + the same 3 again


def opened(browser: Any, path: Path) -> Any:  # noqa: F811
    page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(path.as_uri())
    page.errors = errors
    return page


def ready(page: Any, selector: str, **expected: str) -> None:
    checks = " && ".join(["e.dataset.state === 'ready'"] + [f"e.dataset.{k} === '{v}'" for k, v in expected.items()])
    deadline = time.monotonic() + 30
    script = f"(() => {{ const e = document.querySelector({selector!r}); return !!e && ({checks}); }})()"
    while not page.evaluate(script):
        assert time.monotonic() < deadline, f"{selector} never ready"
        time.sleep(0.05)


@pytest.mark.slow
def test_the_colour_scale_can_leave_bos_out(browser, tmp_path: Path) -> None:  # noqa: F811
    patterns = fake_patterns(["<s>", "a", "b", "c", "d"])
    path = tmp_path / "heatmap.html"
    path.write_text(heatmap_page(patterns.page_payload()), encoding="utf-8")
    page = opened(browser, path)
    ready(page, ".probe-page", layer="0", head="0")
    assert page.evaluate("document.querySelector('.probe-plot').data[0].zmax") == 1
    page.select_option(".probe-scale", "nobos")
    time.sleep(0.5)
    ready(page, ".probe-page", layer="0", head="0")
    weights = patterns.values[0] / 1000
    expected = max(weights[q, k] for q in range(5) for k in range(1, q + 1))
    assert page.evaluate("document.querySelector('.probe-plot').data[0].zmax") == pytest.approx(expected, abs=1e-3)
    assert expected < weights[:, 0].max()  # the first key's weights would have set the scale
    assert not page.errors, page.errors


def test_repeat_boundary_and_expected_diagonal_are_marked(browser, tmp_path: Path) -> None:  # noqa: F811
    tokens = ["<s>", "x", "y", "z", "x", "y", "z"]
    patterns = fake_patterns(tokens)
    patterns.thumbnails = None
    patterns.meta = {"probe_set": "repeated", "repeat_len": R, "offset": 1}
    scores = {name: torch.zeros(2, 2) for name in ("induction", "duplicate_token", "sink")}
    scores["induction"][1, 1] = scores["duplicate_token"][0, 1] = scores["sink"][1, 0] = 0.9
    result = Classification(model="m", n_layers=2, n_heads=2, scores=scores,
                            thresholds={"induction": 0.4, "duplicate_token": 0.4, "sink": 0.3})
    blocks = {"repeated": patterns.page_payload(), "natural": fake_patterns(tokens).page_payload()}
    page_text = classification_page(result.to_dict(), blocks)
    spec = page_data(page_text)["patterns"]["repeated"]
    assert (spec["repeat"], spec["offset"], spec["first"]) == (R, 1, 0)
    path = tmp_path / "classify.html"
    path.write_text(page_text, encoding="utf-8")
    page = opened(browser, path)
    boundary = 1 + R - 0.5  # between the first copy and the second
    for index, name, shift in ((0, "induction", 1 - R), (1, "duplicate_token", -R)):
        box = f'[data-score-index="{index}"]'
        ready(page, box)
        shapes = page.evaluate(f"document.querySelector('{box} .probe-plot').layout.shapes")
        assert {(s["x0"], s["x1"]) for s in shapes[:2]} == {(-0.5, 6.5), (boundary, boundary)}
        diagonal = shapes[2]
        assert (diagonal["y0"], diagonal["y1"]) == (1 + R, 6) and diagonal["line"]["dash"] == "dot"
        assert (diagonal["x0"] - diagonal["y0"], diagonal["x1"] - diagonal["y1"]) == (shift, shift), name
        assert np.isclose(diagonal["x0"], 1 + R + shift)
    ready(page, '[data-score-index="2"]')  # a class without an expected diagonal: nothing drawn over it
    assert page.evaluate("document.querySelector('[data-score-index=\"2\"] .probe-plot').layout.shapes") == []
    assert not page.errors, page.errors


def token_weights(page: Any) -> list[str]:
    return page.evaluate("Array.from(document.querySelectorAll('.probe-tokens span')).map(s => s.dataset.weight)")


def test_a_click_on_a_token_shows_its_attention_over_the_text(browser, tmp_path: Path) -> None:  # noqa: F811
    tokens = ["<s>", "<b>x</b>", "y", "␣z", "x", "y"]
    patterns = fake_patterns(tokens)
    path = tmp_path / "heatmap.html"
    path.write_text(heatmap_page(patterns.page_payload()), encoding="utf-8")
    page = opened(browser, path)
    ready(page, ".probe-page", layer="0", head="0")
    spans = page.locator(".probe-tokens span")
    assert [spans.nth(i).text_content() for i in range(len(tokens))] == tokens  # text, never markup
    page.locator(".probe-tokens span").nth(3).click()
    weights = patterns.values[0] / 1000
    assert token_weights(page) == [str(weights[3, k]) if k <= 3 else "" for k in range(6)]
    assert page.get_attribute(".probe-tokens", "data-query") == "3"
    page.select_option(".probe-layer", "1")  # another head: the same query, that head's weights
    ready(page, ".probe-page", layer="1", head="0")
    other = patterns.values[patterns.index(1, 0)] / 1000
    assert token_weights(page) == [str(other[3, k]) if k <= 3 else "" for k in range(6)]
    plot = page.locator(".probe-plot")
    plot.scroll_into_view_if_needed()
    x, y = page.evaluate("(() => { const gd = document.querySelector('.probe-plot'), l = gd._fullLayout; "
                         "const r = gd.getBoundingClientRect(); return [r.left + l.xaxis._offset + l.xaxis.l2p(1), "
                         "r.top + l.yaxis._offset + l.yaxis.l2p(5)]; })()")
    page.mouse.click(x, y)  # a cell of query 5: the token view follows
    deadline = time.monotonic() + 10
    while page.get_attribute(".probe-tokens", "data-query") != "5":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert token_weights(page) == [str(other[5, k]) for k in range(6)]
    assert not page.errors, page.errors


def test_labels_stay_readable_at_150_tokens_and_follow_a_zoom(browser, tmp_path: Path) -> None:  # noqa: F811
    patterns = fake_patterns([f"tok{i}" for i in range(150)])
    path = tmp_path / "long.html"
    path.write_text(heatmap_page(patterns.page_payload()), encoding="utf-8")
    page = opened(browser, path)
    ready(page, ".probe-page", layer="0", head="0")
    ticks = "Array.from(document.querySelectorAll('.probe-plot .xtick text')).map(t => t.textContent)"
    shown = page.evaluate(ticks)
    assert 10 <= len(shown) < 150  # thinned so that they do not overlap
    boxes = page.evaluate("Array.from(document.querySelectorAll('.probe-plot .ytick text'))"
                          ".map(t => t.getBoundingClientRect()).map(r => [r.top, r.bottom])")
    boxes = sorted(boxes)
    assert all(a[1] <= b[0] + 0.5 for a, b in zip(boxes, boxes[1:]))  # no two labels overlap
    page.evaluate("Plotly.relayout(document.querySelector('.probe-plot'), "
                  "{'xaxis.range': [9.5, 30.5], 'yaxis.range': [30.5, 9.5]})")
    deadline = time.monotonic() + 10
    while page.evaluate(ticks)[:1] != ["10:tok10"]:
        assert time.monotonic() < deadline, page.evaluate(ticks)
        time.sleep(0.05)
    assert page.evaluate(ticks) == [f"{i}:tok{i}" for i in range(10, 31)]  # zoomed: every label, in order

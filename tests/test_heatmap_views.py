"""Heatmap views in a real Chromium: a colour scale that leaves BOS out, and the repeat boundary and the diagonal an
induction / duplicate-token head should follow marked on the classify page's patterns."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from probe.classify import Classification
from reports.html import classification_page, heatmap_page
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
    while not page.evaluate(f"(() => {{ const e = document.querySelector({selector!r}); return !!e && ({checks}); }})()"):
        assert time.monotonic() < deadline, f"{selector} never ready"
        time.sleep(0.05)


def test_the_colour_scale_can_leave_bos_out(browser, tmp_path: Path) -> None:  # noqa: F811
    patterns = fake_patterns(["<s>", "a", "b", "c", "d"])
    path = tmp_path / "heatmap.html"
    path.write_text(heatmap_page(patterns.to_dict()), encoding="utf-8")
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
    blocks = {"repeated": patterns.to_dict(), "natural": fake_patterns(tokens).to_dict()}
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

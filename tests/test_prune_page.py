"""The pruning page in headless Chromium: every curve drawn, the random band, the limits, text escaped."""

from __future__ import annotations

import pytest

from probe.reports.prune import prune_page
from test_browser import browser, open_page, screenshot  # noqa: F401 (fixtures)
from test_html import IMG, SCRIPT

pytestmark = pytest.mark.browser


def _curve(ordering: str, seed, losses: list[float]) -> dict:
    steps = [{"step": i, "units_removed": 2 * i, "heads_removed": 2 * i, "share_pruned": i / 4, "loss": loss,
              "delta": loss - 3.0, "removed": []} for i, loss in enumerate(losses)]
    return {"ordering": ordering, "seed": seed, "stopped": "every unit pruned", "kept_mask": [[1]], "steps": steps}


def test_prune_page_draws_every_curve_and_the_band(tmp_path, open_page):  # noqa: F811
    payload = {"model": SCRIPT, "metric": "cross_entropy", "method": "zero", "data": f"file {IMG}", "units": "heads",
               "n_units": 8, "n_layers": 2, "n_heads": 4, "baseline_loss": 3.0, "step": 0.25, "max_loss": 3.3,
               "seconds": 1.0, "costs": {}, "note": f"note {SCRIPT}",
               "curves": [_curve("michel", None, [3.0, 3.01, 3.1, 3.5, 6.0]),
                          _curve("sweep", None, [3.0, 3.02, 3.2, 3.6, 6.0]),
                          _curve("random", 0, [3.0, 3.2, 3.9, 5.0, 6.0]),
                          _curve("random", 1, [3.0, 3.3, 4.1]),
                          _curve("random", 2, [3.0, 3.1, 3.7, 4.5, 6.0])]}
    path = tmp_path / "prune.html"
    path.write_text(prune_page(payload), encoding="utf-8")
    opened = open_page(path)
    assert opened.page.text_content("h1") == f"Pruning curves of {SCRIPT}"
    traces = opened.page.evaluate("document.querySelector('.probe-prune-plot').data")
    low, high, michel, sweep = traces
    assert low["y"] == [3.0, 3.1, 3.7, 4.5, 6.0] and high["y"] == [3.0, 3.3, 4.1, 5.0, 6.0]
    assert high["fill"] == "tonexty" and "3 seeds" in high["name"]
    assert michel["y"] == [3.0, 3.01, 3.1, 3.5, 6.0] and michel["x"] == [0, 0.25, 0.5, 0.75, 1.0]
    assert sweep["name"] == "single-head sweep order"
    shapes = opened.page.evaluate("document.querySelector('.probe-prune-plot').layout.shapes")
    assert [shape["y0"] for shape in shapes] == [3.0, 3.3]
    assert opened.page.locator(".probe-prune-plot .scatterlayer .trace").count() == 4
    screenshot(opened, "prune.png")
    opened.check_clean()

"""The patching page in headless Chromium: the patch-effect and DLA maps, the by-position view, text escaped."""

from __future__ import annotations

import pytest

from probe.reports.patching import patch_page, ranked
from test_browser import browser, open_page, screenshot  # noqa: F401 (fixtures)
from test_html import IMG, SCRIPT
from test_patching import ioi_runs

pytestmark = pytest.mark.browser


@pytest.mark.slow
def test_patch_page_draws_the_maps_and_the_positions(tmp_path, open_page, monkeypatch):  # noqa: F811
    import probe.inputs.contrast as contrast
    from probe.patching import patch_heads
    from test_specific import words_loaded

    monkeypatch.setattr(contrast, "MIN_GAP", 1e-4)  # a random tiny model's corruption changes little
    loaded = words_loaded()
    clean, corrupt = ioi_runs(loaded, count=4)
    result = patch_heads(loaded, clean, corrupt, [(0, 1), (1, 0), (1, 3)], by_position=True, batch_size=4)
    result.dla = [[0.1 * layer - 0.05 * head for head in range(result.n_heads)] for layer in range(result.n_layers)]
    from probe.patching.paths import path_patch

    result.paths = path_patch(loaded, clean, corrupt, [(0, 1), (0, 2)], [(1, 0)], batch_size=4).to_dict()
    payload = result.to_dict() | {"model": SCRIPT}
    payload["tokens"][2] = IMG
    path = tmp_path / "patch.html"
    path.write_text(patch_page(payload), encoding="utf-8")
    opened = open_page(path)
    assert opened.page.text_content("h1") == f"Activation patching of {SCRIPT}"
    effect = opened.page.evaluate("document.querySelector('.probe-patch-effect').data[0]")
    for row in payload["heads"]:
        assert effect["z"][row["layer"]][row["head"]] == pytest.approx(row["patch_effect"], abs=1e-6)
    assert effect["z"][0][0] is None and effect["zmid"] == 0
    dla = opened.page.evaluate("document.querySelector('.probe-patch-dla').data[0]")
    assert dla["z"][1][0] == pytest.approx(0.1) and dla["z"][1][3] == pytest.approx(-0.05)
    spots = opened.page.evaluate("document.querySelector('.probe-patch-position').data[0]")
    assert len(spots["y"]) == 3 and len(spots["x"]) == len(payload["tokens"])
    assert IMG.replace("<", "&lt;").replace(">", "&gt;") in spots["x"][2]  # shown as text, not read as HTML
    assert opened.page.locator(".probe-patch-position .heatmaplayer image").count() >= 1
    paths = opened.page.evaluate("document.querySelector('.probe-patch-paths').data[0]")
    assert paths["y"] == ["0.1", "0.2"]
    assert paths["z"][1][0] == pytest.approx(payload["paths"]["patch_effect"][1][0], abs=1e-6)
    table = opened.page.evaluate("Array.from(document.querySelectorAll('table.probe-ranked tr')).slice(1)"
                                 ".map(row => Array.from(row.cells).map(cell => cell.textContent))")
    expected = ranked(payload)  # the terminal report's table, as the page's ranked list
    assert [row[1] for row in table] == [f"{row['patch_effect']:+.3f}" for row in expected]
    assert all(f"{row['layer']}.{row['head']}" in cells[0] for row, cells in zip(expected, table))
    screenshot(opened, "patch.png")
    opened.check_clean()

"""The track page in headless Chromium (fixtures of test_browser): one line per head in each class's plot, the flagged
heads coloured and named in hovers, the in-context learning score on the step axis, the step slider redraws the layer x
head grid with that checkpoint's scores, text stays text, nothing is fetched."""

from __future__ import annotations

import pytest

from probe.reports.track import track_page
from probe.track import CheckpointResult, TrackResult
from test_browser import browser, open_page, screenshot  # noqa: F401 (fixtures)
from test_html import SCRIPT

pytestmark = pytest.mark.browser


def payload() -> dict:
    """A hand-made run of a 2 x 2 model: head 1.1's induction score jumps between steps 20 and 30."""
    def checkpoint(step: int, jump: float) -> CheckpointResult:
        heads = [{"layer": layer, "head": head, "scores": {"induction": round(0.01 * (layer + head) + (
            jump if (layer, head) == (1, 1) else 0), 6), "sink": 0.1}} for layer in range(2) for head in range(2)]
        return CheckpointResult(f"{SCRIPT}-{step}", step, 3.0 - jump, -jump, heads)

    run = [checkpoint(10, 0.0), checkpoint(20, 0.05), checkpoint(30, 0.8), checkpoint(40, 0.85)]
    return TrackResult(SCRIPT, "state_dicts", run, {"induction": 0.4, "sink": 0.3}, {}, {
        "early": 50, "late": 500, "icl_seqs": 64}).to_dict()


@pytest.mark.slow
def test_track_page(tmp_path, open_page):  # noqa: F811
    data = payload()
    assert [(c["class"], c["from_step"], c["to_step"], c["heads"]) for c in data["phase_changes"]] == [
        ("induction", 20, 30, ["1.1"])]
    path = tmp_path / "track.html"
    path.write_text(track_page(data), encoding="utf-8")
    opened = open_page(path, wait=False)
    opened.wait_ready(step="40", cls="induction")
    assert opened.page.text_content("h1") == f"Heads across training: {SCRIPT}"
    lines = opened.page.evaluate("document.querySelector('.probe-track-class[data-class=\"induction\"]').data"
                                 ".map(t => [t.name, t.y, t.mode, t.hovertemplate])")
    assert len(lines) == 4 and lines[-1][0] == "1.1" and lines[-1][2] == "lines+markers"  # flagged: drawn last
    assert lines[-1][1] == [0.02, 0.07, 0.82, 0.87] and lines[-1][3].startswith("layer 1, head 1: ")
    assert all(mode == "lines" for _, _, mode, _ in lines[:3])
    icl = opened.page.evaluate("document.querySelector('.probe-track-icl').data.map(t => [t.x, t.y])")
    assert icl[0] == [[10, 20, 30, 40], [0, -0.05, -0.8, -0.85]]
    opened.page.fill(".probe-track-slider", "1")
    opened.wait_ready(step="20", cls="induction")
    assert opened.page.evaluate("document.querySelector('.probe-track-grid').data[0].z") == [[0, 0.01], [0.01, 0.07]]
    opened.page.select_option(".probe-track-select", "sink")
    opened.wait_ready(step="20", cls="sink")
    assert opened.page.evaluate("document.querySelector('.probe-track-grid').data[0].z") == [[0.1, 0.1], [0.1, 0.1]]
    assert SCRIPT in opened.page.text_content(".probe-track-step")
    assert opened.page.locator(".probe-page script").count() == 1
    screenshot(opened, "track.png")
    opened.check_clean()

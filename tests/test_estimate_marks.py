"""An estimate says it is one: every value of `--method estimate` is marked estimated or exact in JSON, CSV, the
terminal and the page, and the page says how the estimate was made."""

from __future__ import annotations

import csv
import io
import json
import re
import time

import pytest

from conftest import tiny_loaded
from probe.ablation import estimate
from probe.inputs import repeated_set
from probe.reports.files import write_csv
from probe.reports.html import ablation_page
from test_browser import ARGS, CHROMIUM


def page_data(page: str) -> dict:
    return json.loads(re.search(r'id="[^"]+-data">(.*?)</script>', page, re.S).group(1))


def test_every_value_of_an_estimate_is_marked_estimated_or_exact(tmp_path) -> None:
    loaded = tiny_loaded("llama_gqa")
    result = estimate(loaded, repeated_set(loaded, repeat_len=8, num_seqs=2))
    payload = result.to_dict()
    exact = {(e["layer"], e["head"]): e["exact"] for e in payload["heads"]}
    assert set(exact.values()) == {True, False}  # some heads ablated for real, the rest estimated

    write_csv(tmp_path / "e.csv", result.csv_rows())
    rows = list(csv.DictReader(io.StringIO((tmp_path / "e.csv").read_text(encoding="utf-8"))))
    assert {(int(r["layer"]), int(r["head"])): r["value"] for r in rows} == {
        head: "exact" if is_exact else "estimated" for head, is_exact in exact.items()}

    page = ablation_page(payload)
    data = page_data(page)
    for (layer, head), is_exact in exact.items():
        assert data["how"][layer][head] == ("ablated exactly" if is_exact else "estimated")
    for label, how in zip(data["top"]["label"], data["top"]["how"]):
        layer, head = map(int, label.split("."))
        assert how == ("ablated exactly" if exact[layer, head] else "estimated")
    n_exact = sum(exact.values())
    assert f"{n_exact} ablated exactly, {len(exact) - n_exact} estimated, of 2 layers x 4 heads" in page
    assert "zero ablation, one head at a time, estimated (see below)" in page
    assert "attribution patching" in page and f"How: {payload['path']}" in page
    assert "Spearman ≥ 0.9 against the exact sweep within 10 forward-equivalents" in page


def test_a_sweep_page_and_csv_carry_no_estimate_marks(tmp_path) -> None:
    heads = [{"layer": 0, "head": h, "loss": 2.0, "delta": 0.1 * h} for h in range(3)]
    page = ablation_page({"model": "m", "method": "zero", "mode": "exact", "baseline_loss": 1.9, "heads": heads})
    assert "how" not in page_data(page) and "probe-estimate-note" not in page and "3 ablated of" in page


@pytest.mark.slow
@pytest.mark.browser
def test_the_page_hatches_estimated_bars_and_says_so_in_hovers(tmp_path) -> None:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing (see tests/browser.sh)")
    from playwright.sync_api import sync_playwright

    heads = [{"layer": layer, "head": head, "loss": 2.0, "delta": 0.1 * (layer + head) + 0.01,
              "exact": (layer, head) == (1, 2)} for layer in range(2) for head in range(3)]
    path = tmp_path / "estimate.html"
    path.write_text(ablation_page({"model": "m", "method": "zero", "mode": "estimate", "path": "estimate: how",
                                   "baseline_loss": 2.0, "heads": heads}), encoding="utf-8")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=ARGS, headless=True)
        page = browser.new_page()
        page.goto(path.as_uri())
        deadline = time.monotonic() + 30
        while page.evaluate("document.querySelector('.probe-page').dataset.state") != "ready":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        bars = page.evaluate("document.querySelector('.probe-bar-plot')._fullData[0]")
        assert bars["marker"]["pattern"]["shape"] == ["", "/", "/", "/", "/", "/"]  # 1.2 exact: solid, first
        assert bars["text"][0] == "layer 1, head 2, ablated exactly" and bars["text"][1].endswith(", estimated")
        grid = page.evaluate("document.querySelector('.probe-delta-plot')._fullData[0]")
        assert grid["hovertemplate"].endswith(", %{text}<extra></extra>") and grid["text"][1][2] == "ablated exactly"
        browser.close()

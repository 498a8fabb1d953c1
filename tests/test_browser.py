"""Every kind of page in a real headless Chromium, opened from file://: drawn, interactive, offline and inert.

Needs Debian's `chromium` (/usr/bin/chromium) and playwright-python; playwright drives the system browser, it
downloads nothing. Screenshots go to tests/artifacts/ (gitignored).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import ARTIFACTS
from probe.hooks.capture import capture_attention
from probe.heads.classify import Classification, classify
from probe.inputs import repeated_set
from probe.patterns import AVERAGE, Patterns, classification_patterns, text_ids, text_patterns
from probe.reports.html import ablation_page, classification_page, heatmap_page
from test_html import IMG, SCRIPT, fake_patterns

CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TOLERANCE = 5e-4 + 1e-6  # three decimals
TEXT = (f"The cat sat on the mat.\n\tThe cat sat  on the mat. {SCRIPT} and {IMG} then &amp; the end")

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing: apt-get install -y chromium (see tests/browser.sh)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=ARGS, headless=True)
        yield chromium
        chromium.close()


@dataclass
class Opened:
    """A page and everything it did: console messages, errors, requests, dialogs."""

    page: Any
    url: str
    console: list[tuple[str, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)

    def check_clean(self) -> None:
        """No console errors, no request but the page itself, no dialog, no injected element."""
        assert not self.errors, self.errors
        assert not [text for kind, text in self.console if kind in ("error", "warning")], self.console
        assert self.requests == [self.url], self.requests
        assert not self.dialogs, self.dialogs
        assert self.page.evaluate("document.querySelectorAll('img, iframe, object, embed').length") == 0

    def wait_ready(self, selector: str = ".probe-page", timeout: float = 30.0, **expected: str) -> None:
        """Poll from Python: playwright's wait_for_function evaluates strings in the page, which the page's
        Content-Security-Policy (rightly) forbids."""
        checks = " && ".join(["e.dataset.state === 'ready'"]
                             + [f"e.dataset.{k} === '{v}'" for k, v in expected.items()])
        script = f"(() => {{ const e = document.querySelector({selector!r}); return !!e && ({checks}); }})()"
        deadline = time.monotonic() + timeout
        while not self.page.evaluate(script):
            state = self.page.evaluate(f"(document.querySelector({selector!r}) || {{dataset: {{}}}}).dataset.state")
            assert state != "error", self.page.text_content(".probe-error")
            assert time.monotonic() < deadline, f"{selector} not ready with {expected}: state {state}"
            time.sleep(0.05)

    def z(self, selector: str = ".probe-plot") -> list[list[float | None]]:
        return self.page.evaluate(f"document.querySelector({selector!r}).data[0].z")


@pytest.fixture
def open_page(browser: Any) -> Iterator[Any]:
    contexts = []

    def opener(path: Path, wait: bool = True) -> Opened:
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        contexts.append(context)
        page = context.new_page()
        opened = Opened(page, path.resolve().as_uri())
        page.on("console", lambda message: opened.console.append((message.type, message.text)))
        page.on("pageerror", lambda error: opened.errors.append(str(error)))
        page.on("request", lambda request: opened.requests.append(request.url))
        page.on("dialog", lambda dialog: (opened.dialogs.append(dialog.message), dialog.dismiss()))
        page.goto(opened.url)
        if wait:
            opened.wait_ready()
        return opened

    yield opener
    for context in contexts:
        context.close()


def screenshot(opened: Opened, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    opened.page.screenshot(path=str(ARTIFACTS / name), full_page=True)


def assert_pattern(drawn: list[list[float | None]], expected: np.ndarray, causal: bool = True) -> None:
    """The drawn z equals the captured weights (to the page's three decimals); the future is null, not 0."""
    n = expected.shape[0]
    assert len(drawn) == n and all(len(row) == n for row in drawn)
    for q in range(n):
        for k in range(n):
            if causal and k > q:
                assert drawn[q][k] is None, (q, k)
            else:
                assert abs(drawn[q][k] - expected[q, k]) <= TOLERANCE, (q, k, drawn[q][k], expected[q, k])


def tick_texts(opened: Opened, axis: str, selector: str = ".probe-plot") -> list[str]:
    return opened.page.evaluate(f"Array.from(document.querySelector({selector!r})"
                                f".querySelectorAll('.{axis}tick text')).map(t => t.textContent)")


def cell_point(opened: Opened, selector: str, x: float, y: float) -> tuple[float, float]:
    """Where on the screen plotly draws the cell at axis positions (x, y) (category index or number)."""
    opened.page.locator(selector).scroll_into_view_if_needed()
    return tuple(opened.page.evaluate(
        f"(() => {{ const gd = document.querySelector({selector!r}), l = gd._fullLayout; "
        "const r = gd.getBoundingClientRect(); "
        f"return [r.left + l.xaxis._offset + l.xaxis.l2p({x}), r.top + l.yaxis._offset + l.yaxis.l2p({y})]; }})()"))


def hover_text(opened: Opened, q: int, k: int, selector: str = ".probe-plot") -> str:
    """Move the mouse over cell (query q, key k) and read plotly's hover label."""
    opened.page.mouse.move(*cell_point(opened, selector, k, q))
    opened.page.wait_for_timeout(50)
    return opened.page.evaluate(
        f"Array.from(document.querySelector({selector!r}).querySelectorAll('.hoverlayer .hovertext text'))"
        ".map(t => t.textContent).join(' | ')")


# ---------------------------------------------------------------------------------------------------------------


def test_heatmap_page_draws_the_captured_attention(smollm2, tmp_path, open_page):
    patterns = text_patterns(smollm2, TEXT, source=f"text file {IMG}.txt")
    path = tmp_path / "heatmap.html"
    path.write_text(heatmap_page(patterns.page_payload()), encoding="utf-8")
    ids = text_ids(smollm2, TEXT)
    captured = capture_attention(smollm2.model, __import__("torch").tensor([ids]))
    opened = open_page(path)
    opened.wait_ready(layer="0", head="0")
    assert opened.page.locator(".probe-plot .heatmaplayer image").count() >= 1  # plotly drew the heatmap
    first = opened.z()
    assert_pattern(first, captured[0][0, 0].numpy())

    opened.page.select_option(".probe-layer", "17")
    opened.page.select_option(".probe-head", "3")
    opened.wait_ready(layer="17", head="3")
    drawn = opened.z()
    assert drawn != first
    assert_pattern(drawn, captured[17][0, 3].numpy())

    opened.page.select_option(".probe-head", "-1")  # the average over the layer's heads
    opened.wait_ready(layer="17", head="-1")
    assert_pattern(opened.z(), captured[17][0].mean(0).numpy())
    assert "mean of 9 heads" in opened.page.text_content(".probe-plot-title")

    opened.page.click('canvas.probe-thumb[data-layer="5"][data-head="2"]')  # the overview selects on click
    opened.wait_ready(layer="5", head="2")
    assert_pattern(opened.z(), captured[5][0, 2].numpy())
    assert opened.page.input_value(".probe-layer") == "5" and opened.page.input_value(".probe-head") == "2"
    assert opened.page.locator("canvas.probe-thumb").count() == 30 * 10

    ticks = tick_texts(opened, "y")
    assert "0:⟨<|im_start|>⟩" in ticks
    labels = opened.page.evaluate("document.querySelector('.probe-plot').data[0].y")
    assert len(set(labels)) == len(labels)  # repeated tokens stay distinct
    for symbol in ("↵", "⇥", "␣"):  # whitespace is visible, in the hover of a query that has it
        q = next(i for i, token in enumerate(patterns.tokens) if symbol in token)
        assert f"{q}:{patterns.tokens[q]} → 1:{patterns.tokens[1]}: " in hover_text(opened, q, 1)
    q = next(i for i, token in enumerate(patterns.tokens) if "script" in token)
    assert f"{q}:{patterns.tokens[q]} → {q - 1}:{patterns.tokens[q - 1]}: " in hover_text(opened, q, q - 1)
    assert opened.page.text_content("td:text('input') + td") == f"text file {IMG}.txt"
    screenshot(opened, "heatmap_smollm2.png")
    opened.check_clean()


@pytest.mark.slow
@pytest.mark.parametrize("causal", [True, False])
def test_injected_text_stays_text(tmp_path, open_page, causal):
    tokens = [SCRIPT, IMG, "&amp;", "<b>bold</b>", "␣the", "␣the"]
    path = tmp_path / "injection.html"
    patterns = fake_patterns(tokens, model=SCRIPT, source=f"text file {IMG}", causal=causal)
    path.write_text(heatmap_page(patterns.page_payload()), encoding="utf-8")
    opened = open_page(path)
    assert_pattern(opened.z(), patterns.values[0] / 1000, causal=causal)  # an encoder's pattern has no blank
    opened.page.click('canvas.probe-thumb[data-layer="1"][data-head="-1"]')
    opened.wait_ready(layer="1", head="-1")
    assert_pattern(opened.z(), patterns.values[patterns.index(1, -1)] / 1000, causal=causal)
    assert opened.page.text_content("h1") == f"Attention of {SCRIPT}"
    assert opened.page.evaluate("document.title") == f"probe heatmap: {SCRIPT}"
    assert opened.page.evaluate("document.querySelectorAll('script').length") == 4  # data, plotly, runtime, start
    ticks = tick_texts(opened, "x")
    assert ticks[:4] == [f"0:{SCRIPT}", f"1:{IMG}", "2:&amp;", "3:<b>bold</b>"]
    hover = hover_text(opened, 1, 0)
    assert f"1:{IMG} → 0:{SCRIPT}: " in hover
    assert opened.page.locator(".probe-plot b").count() == 0
    screenshot(opened, f"heatmap_injection_{'causal' if causal else 'encoder'}.png")
    opened.check_clean()


def test_classification_page(smollm2, tmp_path, open_page):
    options = {"seq_len": 48, "repeat_len": 24}
    result = classify(smollm2, num_seqs=2, **options)
    result.model = f"smollm2 {SCRIPT}"
    patterns = classification_patterns(smollm2, result, **options)
    path = tmp_path / "classify.html"
    page = classification_page(result.to_dict(), {name: block.page_payload() for name, block in patterns.items()})
    path.write_text(page, encoding="utf-8")
    opened = open_page(path)
    assert opened.page.text_content("h1") == f"Head classification of smollm2 {SCRIPT}"
    for index, name in enumerate(result.scores):
        box = f'[data-score-index="{index}"]'
        if opened.page.query_selector(f"{box}.probe-empty-class") is not None:  # a class no head scores on
            assert not result.flagged(name) and not result.scores[name].any()
            continue
        grid = opened.page.evaluate(f"document.querySelector('{box} .probe-score-plot').data")
        np.testing.assert_allclose(np.array(grid[0]["z"], dtype=float), result.scores[name].numpy(), atol=1e-4)
        flagged = result.flagged(name)
        assert list(zip(grid[1]["y"], grid[1]["x"])) == [(layer, head) for layer, head, _ in flagged]

    induction = list(result.scores).index("induction")
    box = f'[data-score-index="{induction}"]'
    flagged = result.flagged("induction")
    assert len(flagged) >= 2, "SmolLM2 has induction heads"
    repeated = repeated_set(smollm2, repeat_len=24, num_seqs=2).input_ids[:1]
    captured = capture_attention(smollm2.model, repeated, layers={layer for layer, _, _ in flagged})
    layer, head, _ = flagged[0]
    opened.wait_ready(box, layer=str(layer), head=str(head))
    assert_pattern(opened.z(f"{box} .probe-plot"), captured[layer][0, head].numpy())
    first = opened.z(f"{box} .probe-plot")

    layer, head, _ = flagged[1]
    opened.page.select_option(f"{box} .probe-flagged", f"{layer},{head}")
    opened.wait_ready(box, layer=str(layer), head=str(head))
    assert opened.z(f"{box} .probe-plot") != first
    assert_pattern(opened.z(f"{box} .probe-plot"), captured[layer][0, head].numpy())

    layer, head, _ = flagged[-1]  # a click on a marked head in the grid shows its pattern
    opened.page.mouse.click(*cell_point(opened, f"{box} .probe-score-plot", head, layer))
    opened.wait_ready(box, layer=str(layer), head=str(head))
    assert_pattern(opened.z(f"{box} .probe-plot"), captured[layer][0, head].numpy())
    opened.page.locator(box).scroll_into_view_if_needed()
    opened.page.locator(box).screenshot(path=str(ARTIFACTS / "classify_induction.png"))
    screenshot(opened, "classify_smollm2.png")
    opened.check_clean()


def test_ablation_page(tmp_path, open_page):
    heads = [{"layer": layer, "head": head, "loss": 3.0 + 0.01 * (layer - head), "delta": 0.01 * (layer - head)}
             for layer in range(6) for head in range(4) if (layer, head) != (2, 2)]
    heads[5]["delta"] = -0.2
    result = {"model": SCRIPT, "method": "mean", "data": f"text file {IMG}", "baseline_loss": 3.0, "heads": heads}
    path = tmp_path / "ablate.html"
    path.write_text(ablation_page(result), encoding="utf-8")
    opened = open_page(path)
    assert opened.page.text_content("h1") == f"Head ablation of {SCRIPT}"
    grid = opened.page.evaluate("document.querySelector('.probe-delta-plot').data[0]")
    for item in heads:
        assert grid["z"][item["layer"]][item["head"]] == pytest.approx(item["delta"])
    assert grid["z"][2][2] is None and grid["zmid"] == 0
    bars = opened.page.evaluate("document.querySelector('.probe-bar-plot').data[0]")
    assert bars["y"][0] == f"{heads[5]['layer']}.{heads[5]['head']}" and bars["x"][0] == pytest.approx(-0.2)
    assert [abs(x) for x in bars["x"]] == sorted((abs(x) for x in bars["x"]), reverse=True)
    assert opened.page.locator(".probe-delta-plot .heatmaplayer image").count() >= 1
    assert opened.page.locator(".probe-bar-plot .bars path").count() == len(bars["x"])
    screenshot(opened, "ablate.png")
    opened.check_clean()


@pytest.mark.slow
def test_notebook_results_render(tmp_path, open_page):
    """Jupyter inserts outputs as HTML and runs their scripts: the first result carries plotly.js, later ones
    (here inserted after load, the way JupyterLab does) find it on the page."""
    import torch

    result = Classification(model=SCRIPT, n_layers=4, n_heads=3, scores={"sink": torch.rand(4, 3),
                            "induction": torch.rand(4, 3)}, thresholds={"sink": 0.5, "induction": 0.5})
    patterns = fake_patterns([SCRIPT, "a", "b", "c"], model=SCRIPT)
    patterns.thumbnails = None  # as classification_patterns makes them: no overview
    first, second = (classification_page(result.to_dict(), embed_plotly=False) for _ in range(2))
    third = heatmap_page(patterns.page_payload(), embed_plotly=False)
    path = tmp_path / "notebook.html"
    path.write_text(f"<!DOCTYPE html><html><head><meta charset='utf-8'></head><body>{first}"
                    f"<div id='cell2'></div><div id='cell3'>{third}</div></body></html>", encoding="utf-8")
    opened = open_page(path, wait=False)
    opened.wait_ready(".probe-page")
    opened.page.evaluate("""html => {
        const cell = document.getElementById('cell2');
        cell.innerHTML = html;
        for (const old of Array.from(cell.querySelectorAll('script'))) {
            const fresh = document.createElement('script');
            if (old.type) fresh.type = old.type;
            if (old.id) fresh.id = old.id;
            fresh.textContent = old.textContent;
            old.replaceWith(fresh);
        }
    }""", second)
    opened.wait_ready("#cell2 .probe-page")
    for root in ("body > .probe-page", "#cell2 .probe-page"):
        assert opened.page.locator(f"{root} .probe-score-plot .heatmaplayer image").count() == 2
    opened.wait_ready("#cell3 .probe-page", layer="0", head="0")
    assert_pattern(opened.z("#cell3 .probe-plot"), patterns.values[0] / 1000)
    assert opened.page.text_content("#cell3 h1") == f"Attention of {SCRIPT}"
    assert opened.page.locator("#cell3 canvas").count() == 0  # no thumbnails, no overview
    screenshot(opened, "notebook.png")
    opened.check_clean()


@pytest.mark.slow
def test_ablation_page_scatter_and_top_tokens(tmp_path, open_page):
    """Per-token effects: a scatter of mean delta against specificity, hover naming the head; the top tokens of the
    selected head (first the sharpest, then the clicked one) shown in their text, escaped."""
    heads = [{"layer": layer, "head": head, "loss": 3.0, "delta": 0.01 * (layer + head),
              "effects": {"specificity": 0.1 * (layer + 1), "max_token_delta": 0.1 * (layer + head),
                          "top_tokens": [{"sequence": layer, "position": 5, "delta": 0.5,
                                          "context": f"{SCRIPT} before [tok{layer}.{head}]"}]}}
             for layer in range(3) for head in range(2)]
    path = tmp_path / "ablate_effects.html"
    path.write_text(ablation_page({"model": "m", "method": "zero", "data": "d", "baseline_loss": 3.0,
                                   "heads": heads}), encoding="utf-8")
    opened = open_page(path)
    scatter = opened.page.evaluate("document.querySelector('.probe-scatter-plot').data[0]")
    assert scatter["x"] == pytest.approx([h["delta"] for h in heads])
    assert scatter["y"] == pytest.approx([h["effects"]["specificity"] for h in heads])
    assert scatter["text"][0] == "layer 0, head 0" and "%{text}" in scatter["hovertemplate"]
    assert opened.page.evaluate("document.querySelector('.probe-page').dataset.selected") == "2.1"
    assert opened.page.text_content(".probe-tokens .probe-token") == "[tok2.1]"
    assert SCRIPT in opened.page.text_content(".probe-tokens")  # shown as text, not run
    opened.page.evaluate("document.querySelector('.probe-scatter-plot').emit('plotly_click', "
                         "{points: [{pointIndex: 1}]})")
    assert opened.page.text_content(".probe-tokens .probe-token") == "[tok0.1]"
    screenshot(opened, "ablate_effects.png")
    opened.check_clean()


def long_strip_patterns(n_layers: int = 30, n_heads: int = 9) -> Patterns:
    """A SmolLM2-sized page (30 layers x 9 heads and each layer's average, so the overview sits beside the heatmap
    on a wide window) over 240 tokens and one token of 600 characters without a space: a strip far wider than its
    column. Uniform causal weights: the page stays small."""
    tokens = [f"␣word{i}" for i in range(239)] + ["x" * 600]
    n, heads = len(tokens), [(layer, head) for layer in range(n_layers) for head in [*range(n_heads), AVERAGE]]
    uniform = np.tril(np.ones((n, n))) / np.arange(1, n + 1)[:, None]
    values = np.broadcast_to((uniform * 1000).round().astype(np.uint16), (len(heads), n, n))
    thumbs = np.broadcast_to((uniform[::8, ::8] * 255).round().astype(np.uint8), (len(heads), 30, 30))
    return Patterns(model="m", source="s", tokens=tokens, heads=heads, values=np.ascontiguousarray(values),
                    decimals=3, causal=True, n_layers=n_layers, n_heads=n_heads, total_tokens=n,
                    thumbnails=np.ascontiguousarray(thumbs))


BOXES = """(() => {
  const box = e => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
  const spans = Array.from(document.querySelectorAll('.probe-tokens span')).map(box);
  const strip = [Math.min(...spans.map(b => b[0])), Math.min(...spans.map(b => b[1])),
                 Math.max(...spans.map(b => b[2])), Math.max(...spans.map(b => b[3]))];
  return {strip: strip, column: box(document.querySelector('.probe-main')),
          grid: box(document.querySelector('.probe-overview'))};
})()"""


@pytest.mark.slow
@pytest.mark.parametrize("width", [1000, 1400, 1920])
def test_a_long_token_strip_wraps_inside_its_column(width: int, tmp_path, browser) -> None:
    """The strip under the heatmap ran into the "All heads" grid beside it at 1400 px (its tokens had no place to
    wrap): drawn, the strip's box and the grid's box do not intersect, and the strip stays in its column."""
    path = tmp_path / "strip.html"
    path.write_text(heatmap_page(long_strip_patterns().page_payload()), encoding="utf-8")
    context = browser.new_context(viewport={"width": width, "height": 1000})
    try:
        opened = Opened(context.new_page(), path.resolve().as_uri())
        opened.page.goto(opened.url)
        opened.wait_ready(layer="0", head="0")
        boxes = opened.page.evaluate(BOXES)
        strip, column, grid = boxes["strip"], boxes["column"], boxes["grid"]
        apart = strip[2] <= grid[0] or grid[2] <= strip[0] or strip[3] <= grid[1] or grid[3] <= strip[1]
        assert apart, boxes
        assert column[0] <= strip[0] and strip[2] <= column[2] + 0.5, boxes
        assert strip[3] - strip[1] > 200  # it wrapped onto many lines
        if width >= 1400:
            assert grid[0] >= column[2] and grid[1] < strip[1]  # the grid is beside the column, not under it
        opened.page.screenshot(path=str(tmp_path / "strip.png"))
    finally:
        context.close()


def empty_sections(opened: Opened) -> list[str]:
    """Sections of the page that show nothing: no plot drawn, no table, no text past their heading."""
    return opened.page.evaluate("""() => Array.from(document.querySelectorAll('.probe-section')).filter(section => {
        const text = Array.from(section.children).filter(c => c.tagName !== 'H2')
            .map(c => c.innerText.trim()).join('');
        return !section.querySelector('svg, table, canvas, img') && !text;
    }).map(section => section.dataset.score || section.querySelector('h2')?.innerText || '?')""")


@pytest.mark.parametrize("width", [1000, 1400])
def test_a_class_no_head_can_score_says_so_instead_of_an_empty_grid(width: int, tmp_path, browser) -> None:
    """next-token and sep on a decoder: every score 0. The section says why in a sentence; no empty plot."""
    from conftest import tiny_loaded

    result = classify(tiny_loaded("llama_gqa"), seq_len=16, num_seqs=2, repeat_len=8)
    payload = result.to_dict()
    assert not any(entry["scores"]["next_token"] for entry in payload["heads"])  # a decoder: no key after the query
    path = tmp_path / "classify.html"
    path.write_text(classification_page(payload), encoding="utf-8")
    context = browser.new_context(viewport={"width": width, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(path.resolve().as_uri())
    page.wait_for_function("document.querySelector('.probe-page').dataset.state !== 'loading'", timeout=30000)
    opened = Opened(page, path.resolve().as_uri(), errors=errors)
    assert page.evaluate("document.querySelector('.probe-page').dataset.state") == "ready" and not errors
    note = page.locator('[data-score="next_token"] .probe-meta').inner_text()
    assert "every head scores 0 on this model" in note
    assert page.locator('[data-score="next_token"] .probe-score-plot').count() == 0
    assert empty_sections(opened) == []
    assert page.evaluate("document.documentElement.scrollWidth") <= width  # nothing runs past the right edge
    context.close()

"""probe serve's page in a real headless Chromium, against a real server on 127.0.0.1 (a free port, stopped after):
type a text, click a head, click a cell and a next token, ablate the head and see the numbers change; no console
error, and a `<script>` token shown as text."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from test_browser import Opened, browser  # noqa: F401 (the module's Chromium, launched as every page test does)
from words import tiny_with_words

from probe.models import LoadedModel
from probe.serve import Server, start

pytestmark = pytest.mark.browser
TEXT = "the keys to the cabinet are here , the keys to the cabinet <script>alert(1)</script>"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    model, tokenizer = tiny_with_words()
    tokenizer.add_tokens(["<script>alert(1)</script>"])  # a token that would run if the page used innerHTML
    model.resize_token_embeddings(len(tokenizer))
    running = start(LoadedModel(model=model, tokenizer=tokenizer, name="tiny-words", vocab_size=len(tokenizer)))
    assert running.url.startswith("http://127.0.0.1:")
    yield running
    running.stop()
    assert not running.thread.is_alive()


def wait_for(opened: Opened, selector: str, words: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while words not in (text := opened.page.text_content(selector) or ""):
        assert "probe-error" not in (opened.page.get_attribute("#status", "class") or ""), \
            opened.page.text_content("#status")
        assert time.monotonic() < deadline, f"{selector}: no {words!r} in {text!r}"
        time.sleep(0.05)
    return text


def click_cell(opened: Opened, selector: str, row: float, column: float, rows: int, columns: int) -> None:
    """Click the centre of a heatmap cell (plotly's drag layer takes the click)."""
    box = opened.page.locator(f"{selector} .nsewdrag").first.bounding_box()
    assert box is not None
    opened.page.mouse.click(box["x"] + box["width"] * (column + 0.5) / columns,
                            box["y"] + box["height"] * (row + 0.5) / rows)


@pytest.mark.slow
def test_type_click_ablate(server: Server, browser: Any) -> None:  # noqa: F811
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    opened = Opened(page, server.url)
    page.on("console", lambda message: opened.console.append((message.type, message.text)))
    page.on("pageerror", lambda error: opened.errors.append(str(error)))
    page.on("dialog", lambda dialog: (opened.dialogs.append(dialog.message), dialog.dismiss()))
    page.goto(server.url)
    wait_for(opened, "#model", "tiny-words")
    page.fill("#text", TEXT)
    page.click("#run")
    opened.wait_ready("main")
    tokens = page.locator("#tokens span")
    n = tokens.count()
    assert tokens.nth(n - 1).text_content() == "<script>alert(1)</script>"  # shown as text, not run
    assert page.evaluate("document.querySelectorAll('#tokens script').length") == 0
    click_cell(opened, "#grid", 1, 2, 2, 4)  # layer 1, head 2
    wait_for(opened, "#headname", "1.2")
    wait_for(opened, "#status", "kept from before")  # the text's forward was kept: no new one for the click
    wait_for(opened, "#topkeys", "mean weight")
    click_cell(opened, "#attention", 6, 2, n, n)
    wait_for(opened, "#qkcell", "query 6, key 2")
    wait_for(opened, "#qk", "(the score)")
    tokens.nth(5).click()
    page.locator("#next tr.probe-click").first.click()
    wait_for(opened, "#dlahead", "head 1.2 writes")
    page.click("#add")
    assert page.input_value("#heads") == "1.2"
    page.select_option("#method", "zero")
    page.click("#ablate")
    effect = wait_for(opened, "#effect", "mean loss change")
    assert float(effect.split("mean loss change ")[1].split()[0]) != 0
    cells = page.locator("#compare tr").nth(1).locator("td")
    assert cells.nth(1).text_content() != cells.nth(2).text_content()  # p before, p after
    assert "1.2" in page.url and "method=zero" in page.url  # the state is in the address
    reopened = context.new_page()
    reopened.goto(page.url)
    wait_for(Opened(reopened, page.url), "#headname", "1.2")
    assert not opened.errors and not [text for kind, text in opened.console if kind == "error"], opened.console
    assert not opened.dialogs
    context.close()

"""The picture of `probe serve`'s page (docs/images/serve.png): the default model served on loopback, a sentence
repeated, an induction head clicked, drawn by the headless Chromium the browser tests use. Run from the checkout's
root after `bash install.sh --test`:

    python docs/_build/serve_picture.py             # writes docs/images/serve.png (1400 px wide)
"""

from __future__ import annotations

import time
from urllib.parse import urlencode
from pathlib import Path

from playwright.sync_api import Page, sync_playwright
from readme_picture import ARGS

from probe import load_model
from probe.serve import start

OUT = Path(__file__).resolve().parents[2] / "docs" / "images" / "serve.png"
TEXT = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog."
HEAD = "17.3"  # an induction head of SmolLM2 (probe classify flags it)


def wait_for(page: Page, selector: str, words: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while words not in (page.text_content(selector) or ""):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{selector}: no {words!r}")
        time.sleep(0.1)


def main() -> None:
    server = start(load_model("smollm2"))
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(server.url + "#" + urlencode({"text": TEXT, "head": HEAD}))
            wait_for(page, "#model", "smollm2")
            wait_for(page, "#headname", HEAD)
            wait_for(page, "#topkeys", "mean weight")
            time.sleep(1.0)
            page.screenshot(path=str(OUT), full_page=True)
            browser.close()
    finally:
        server.stop()
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()

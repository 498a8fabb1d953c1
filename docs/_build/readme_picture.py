"""The README's picture (docs/images/heatmap.png): a real `probe heatmap` page of the default model on a repeated
sentence, an induction head selected, drawn by the headless Chromium the browser tests use (Debian's chromium through
playwright). Run from the checkout's root after `bash install.sh --test`:

    python docs/_build/readme_picture.py            # writes docs/images/heatmap.png (~1400 x 900 px)
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "images" / "heatmap.png"
TEXT = ("The quick brown fox jumps over the lazy dog near the old river bank. "
        "The quick brown fox jumps over the lazy dog near the old river bank.")
LAYER, HEAD = "17", "3"  # an induction head of SmolLM2 (probe classify flags it)
QUERY = 19  # " fox" in the second copy: the head attends to the token after the first " fox"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        page_path = Path(folder) / "heatmap.html"
        subprocess.run([sys.executable, "-m", "probe.cli", "-q", "heatmap", "--text", TEXT, "--html", str(page_path)],
                       cwd=ROOT, check=True)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS, headless=True)
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(page_path.as_uri())
            ready = "document.querySelector('.probe-page').dataset"
            page.select_option(".probe-layer", LAYER)
            page.select_option(".probe-head", HEAD)
            deadline = time.monotonic() + 30
            while page.evaluate(f"{ready}.state + {ready}.layer + {ready}.head") != f"ready{LAYER}{HEAD}":
                assert time.monotonic() < deadline, "the page did not draw"
                time.sleep(0.05)
            page.locator(".probe-tokens span").nth(QUERY).click()  # shade the text by that query's attention
            OUT.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(OUT))
            browser.close()
    print(f"wrote {OUT} ({OUT.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()

"""Screenshots of every kind of page probe writes, for the docs: `python docs/_build/screenshots.py [OUT]`.

Runs the commands that write a page (the README's CLI tour, with small inputs: a few minutes on a CPU) on the
default model in a temporary folder, opens each page in Debian's Chromium (/usr/bin/chromium, driven by playwright,
as tests/test_browser.py does) at 1400 px, and writes `OUT/page-<kind>.png` (default docs/images; the README's own
picture, heatmap.png, is readme_picture.py's). It also measures each page at 1000 and 1400 px and prints what a
reader would see as a fault: text past the right edge, a section with nothing in it, an axis label cut by its plot.
The docs pages show the pictures it writes."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--num-seqs", "1", "--seq-len", "24"]
PAGES = {  # kind -> the command that writes it (its --html is added)
    "heatmap": ["heatmap", "--text", "The cat sat on the mat. The cat sat on the mat."],
    "classify": ["classify", *SMALL, "--repeat-len", "12"],
    "ablate": ["ablate", *SMALL],
    "syntax": ["syntax", "--max-sentences", "40"],
    "circuits": ["circuits", *SMALL, "--repeat-len", "12"],
    "prune": ["prune", *SMALL, "--seeds", "1", "--step", "0.1", "--max-increase", "20%"],
    "patch": ["patch", "--task", "ioi", "--count", "4"],
    "kv-heads": ["kv-heads", "--lengths", "256", "--depths", "0.5", "--sink", "4", "--recent", "32", "--steps", "3",
                 "--random-seeds", "0", "--curve-texts", "1"],
    "atlas": ["atlas", *SMALL, "--repeat-len", "12"],
}
WIDTHS = (1000, 1400)
FAULTS = """() => {
  const faults = [], width = document.documentElement.clientWidth;
  const root = document.querySelector('.probe-page');
  if (root && root.dataset.state === 'error') faults.push('the page failed to draw: ' + root.innerText.slice(-200));
  if (document.documentElement.scrollWidth > width + 1) faults.push('the page is wider than the window');
  document.querySelectorAll('.probe-section').forEach(section => {
    const text = Array.from(section.children).filter(c => c.tagName !== 'H2').map(c => c.innerText.trim()).join('');
    if (!section.querySelector('svg, table, canvas, img') && !text)
      faults.push('an empty section: ' + (section.querySelector('h2') || {innerText: '?'}).innerText);
  });
  document.querySelectorAll('.js-plotly-plot').forEach(plot => {
    const box = plot.getBoundingClientRect();
    plot.querySelectorAll('.xtick text, .ytick text').forEach(label => {
      const r = label.getBoundingClientRect();
      if (r.width && (r.left < box.left - 1 || r.right > box.right + 1))
        faults.push('an axis label cut by its plot: ' + label.textContent);
    });
  });
  return faults;
}"""


def write_pages(folder: Path) -> dict[str, Path]:
    """Each kind's page, written by its command into `folder`."""
    pages = {}
    for kind, command in PAGES.items():
        path = folder / f"{kind}.html"
        done = subprocess.run([sys.executable, "-m", "probe.cli", "-q", *command, "--html", str(path)], cwd=ROOT,
                              capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{kind}: {' '.join(command)} failed: {done.stderr.strip()}")
            continue
        pages[kind] = path
    return pages


def shoot(pages: dict[str, Path], out: Path) -> None:
    """A 1400 px screenshot of each page, and its layout faults at every width."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", headless=True,
                                             args=["--no-sandbox", "--disable-gpu"])
        for kind, path in pages.items():
            for width in WIDTHS:
                page = browser.new_page(viewport={"width": width, "height": 900})
                page.goto(path.resolve().as_uri())
                page.wait_for_function("!document.querySelector('.probe-page') || "
                                       "document.querySelector('.probe-page').dataset.state !== 'loading'",
                                       timeout=60000)
                for fault in page.evaluate(FAULTS):
                    print(f"{kind} at {width} px: {fault}")
                if width == 1400:
                    page.screenshot(path=str(out / f"page-{kind}.png"))
                page.close()
        browser.close()


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "images"
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        shoot(write_pages(Path(folder)), out)


if __name__ == "__main__":
    main()

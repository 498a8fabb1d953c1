"""Screenshots of every kind of page probe writes, for the docs: `python docs/_build/screenshots.py [OUT [KIND...]]`.

Runs the commands that write a page (the README's CLI tour, with small inputs: a few minutes on a CPU) on the
default model (track: over a short run of examples/induction/train.py; compare: classify's induction scores in
float32 against bfloat16) in a temporary folder, opens each page in Debian's Chromium (/usr/bin/chromium, driven
by playwright, as tests/test_browser.py does) at 1400 px, and writes `OUT/page-<kind>.png` (default docs/images;
the README's own picture, heatmap.png, is readme_picture.py's). It also checks each page's layout at 1000 and
1400 px with reports/assets/layout.js (the check tests/test_page_layout.py runs on every page kind) and prints
each fault: text clipped by its box, overlapping boxes, a section with nothing in it, plots using too little of
the width, a word broken in a header, an axis past its data. The docs pages show the pictures it writes."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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
    "dla": ["dla", "--task", "ioi", "--count", "4", "--self-repair"],
    "qk": ["qk", "--head", "17.3", "--at", "induction", "--num-seqs", "2"],
    "steer": ["steer", "--heads", "23.3", "--alpha", "0,2,3", "--task", "ioi", "--num-seqs", "4", "--generate",
              "When Mary and John", "--max-new-tokens", "8"],
    "track": ["track", "--model", "examples/induction/model.py:model", "--checkpoints", "{folder}/run/step-*.pt",
              "--icl-positions", "25,250", "--icl-seqs", "64"],  # the example's training run, made first
    "compare": ["compare", "f32.json", "bf16.json", "--score", "induction"],  # the two classify runs, made first
}
PROBE = [sys.executable, "-m", "probe.cli", "-q"]
CLASSIFY = [*PROBE, "classify", *SMALL, "--repeat-len", "12", "--json"]
BEFORE = {  # kind -> the commands that make what its command reads, run first where it runs ({folder}: the folder)
    "track": [[sys.executable, "examples/induction/train.py", "--steps", "120", "--every", "20", "--no-track",
               "--out", "{folder}/run"]],
    "compare": [[*CLASSIFY, "f32.json"], [*CLASSIFY, "bf16.json", "--dtype", "bfloat16"]],
}
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
IN_FOLDER = {"compare"}  # kinds run in the temporary folder, so that their page names its inputs as a reader would
WIDTHS = (1000, 1400)
FAULTS = (ROOT / "reports" / "assets" / "layout.js").read_text(encoding="utf-8")  # () => [fault, ...]
OPEN = {  # kind -> what a reader clicks before the check, so hidden parts are measured too
    "atlas": "tr.atlas-row",  # a head's dashboard
}


def ready(page: Any, timeout: float = 60.0) -> None:
    """Wait until the page has drawn (or failed to): polled from Python, as the page's Content-Security-Policy
    forbids the string functions playwright's wait_for_function evaluates."""
    deadline = time.monotonic() + timeout
    script = "(document.querySelector('.probe-page') || {dataset: {}}).dataset.state"
    while page.evaluate(script) == "loading" and time.monotonic() < deadline:
        time.sleep(0.05)


def layout_faults(page: Any, kind: str) -> list[str]:
    """The layout faults of a drawn page (reports/assets/layout.js), after the clicks of OPEN."""
    ready(page)
    if kind in OPEN:
        page.click(OPEN[kind])
        page.wait_for_timeout(300)
        ready(page)
    return list(page.evaluate(FAULTS))


def _run(args: list[str], folder: Path, kind: str) -> subprocess.CompletedProcess[str]:
    """One command of `kind`, in the repository (or the folder, IN_FOLDER), importing the repository's probe."""
    return subprocess.run([arg.replace("{folder}", str(folder)) for arg in args],
                          cwd=folder if kind in IN_FOLDER else ROOT, env=ENV,
                          capture_output=True, text=True)


def write_pages(folder: Path, kinds: list[str]) -> dict[str, Path]:
    """Each kind's page, written by its command into `folder`, after the commands of BEFORE that make its inputs
    (track's short run of the example's training, compare's two classify runs)."""
    pages = {}
    for kind in kinds:
        path = folder / f"{kind}.html"
        for args in [*BEFORE.get(kind, []), [*PROBE, *PAGES[kind], "--html", str(path)]]:
            done = _run(args, folder, kind)
            if done.returncode != 0:
                print(f"{kind}: {' '.join(args)} failed: {done.stderr.strip()}")
                break
        else:
            pages[kind] = path
    return pages


def shoot(pages: dict[str, Path], out: Path) -> int:
    """A 1400 px screenshot of each page (its top, as a reader first sees it), and its layout faults at every
    width, printed; returns how many faults."""
    from playwright.sync_api import sync_playwright

    count = 0
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", headless=True,
                                             args=["--no-sandbox", "--disable-gpu"])
        for kind, path in pages.items():
            for width in WIDTHS:
                page = browser.new_page(viewport={"width": width, "height": 900})
                page.goto(path.resolve().as_uri())
                ready(page)
                if width == 1400:
                    page.screenshot(path=str(out / f"page-{kind}.png"))
                for fault in layout_faults(page, kind):
                    print(f"{kind} at {width} px: {fault}")
                    count += 1
                page.close()
        browser.close()
    return count


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "images"
    kinds = sys.argv[2:] or list(PAGES)
    unknown = sorted(set(kinds) - set(PAGES))
    if unknown:
        sys.exit(f"error: no page kind {unknown[0]!r}: choose from {', '.join(PAGES)}")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        faults = shoot(write_pages(Path(folder), kinds), out)
    print(f"{faults} layout faults")


if __name__ == "__main__":
    main()

"""`probe atlas` on SmolLM2: time per stage of the default build and of `--fast`, and the page in headless Chromium.

`python -m bench.atlas [--fast] [--skip-build] [--threads 1]` builds the atlas (library `probe.atlas`, the defaults of
`probe atlas`), writes its page, and opens the page from file:// in Debian's Chromium: seconds until the head finder
is interactive (the page's `data-state` is `ready`), then every head's dashboard opened in turn (a table row click),
with the console errors and requests counted. Saves bench/results/atlas.json under `exact` or `fast`
(`python -m bench --render` writes it into RESULTS.md). `--skip-build` keeps the saved build numbers and measures the
page again from the pickled atlas of the last build (bench/results/atlas-{exact,fast}.pkl, not tracked).
"""

from __future__ import annotations

import argparse
import pickle
import shlex
import sys
import time
from pathlib import Path
from typing import Any


from bench.common import RESULTS_DIR, load_average, load_result, machine, now, save_result
from probe.atlas import atlas
from probe.models import load_model
from probe.reports.atlas import atlas_page
from probe.threads import use_threads

CHROMIUM = "/usr/bin/chromium"


def build(fast: bool, log: Any) -> tuple[Any, dict[str, Any]]:
    """The atlas of SmolLM2 with probe atlas's defaults; its stage times and the load around it."""
    loaded = load_model("smollm2")
    before, started = load_average(), time.perf_counter()
    last: dict[str, float] = {}

    def progress(stage: str, done: int, total: int) -> None:
        moment = time.perf_counter()
        if moment - last.get(stage, 0.0) > 30 or done == total:
            last[stage] = moment
            log(f"{moment - started:7.1f} s  {stage} {done}/{total}")

    result = atlas(loaded, fast=fast, progress=progress)
    seconds = time.perf_counter() - started
    return result, {"seconds": round(seconds, 1), "stages": [stage.to_dict() for stage in result.stages],
                    "load_before": before, "load_after": load_average(), "date": now()}


def page_in_chromium(path: Path, n_heads: int) -> dict[str, Any]:
    """Seconds until the head finder is ready, then every dashboard opened; console errors and requests."""
    from playwright.sync_api import sync_playwright  # the bench's own dependency, as in tests/test_browser.py

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox",
                                                                           "--disable-gpu"], headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors: list[str] = []
        requests: list[str] = []
        page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.on("request", lambda request: requests.append(request.url))
        started = time.perf_counter()
        page.goto(path.resolve().as_uri())
        state = "document.querySelector('.probe-page').dataset"
        while page.evaluate(f"{state}.state") not in ("ready", "error"):
            time.sleep(0.02)
        ready = time.perf_counter() - started
        started, opened = time.perf_counter(), 0
        for row in page.evaluate("Array.from(document.querySelectorAll('tr.atlas-row')).map(r => r.dataset.head)"):
            page.click(f"tr.atlas-row[data-head='{row}']")
            while page.evaluate(f"{state}.dashboard") != row and page.evaluate(f"{state}.state") != "error":
                time.sleep(0.01)
            opened += 1
        dashboards = time.perf_counter() - started
        browser.close()
    return {"ready_seconds": round(ready, 2), "dashboards_opened": opened, "heads": n_heads,
            "dashboards_seconds": round(dashboards, 1), "console_errors": errors[:5], "n_console_errors": len(errors),
            "requests": len(requests), "external_requests": [url for url in requests if not url.startswith("file:")]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fast", action="store_true", help="the --fast build (estimated ablation deltas)")
    parser.add_argument("--skip-build", action="store_true", help="measure the page of the last saved build")
    parser.add_argument("--saved", default=None, help="a pickled Atlas built elsewhere with the same defaults: its "
                        "own stage times are the build numbers (the load around it was not recorded)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    args = parser.parse_args()
    if args.threads is not None:
        use_threads(args.threads)
    kind = "fast" if args.fast else "exact"
    saved = RESULTS_DIR / f"atlas-{kind}.pkl"
    data = load_result("atlas") or {}
    entry = data.get(kind, {})
    if args.saved:
        result = pickle.loads(Path(args.saved).read_bytes())
        saved.write_bytes(pickle.dumps(result))
        entry = {"seconds": round(sum(stage.seconds for stage in result.stages), 1), "load_before": None,
                 "load_after": None, "stages": [stage.to_dict() for stage in result.stages], "date": now(),
                 "command": f"atlas(load_model('smollm2'){', fast=True' if args.fast else ''}) in a script; "
                            "stage times from the result"}
    elif args.skip_build:
        result = pickle.loads(saved.read_bytes())
    else:
        result, entry = build(args.fast, lambda text: print(text, file=sys.stderr, flush=True))
        saved.write_bytes(pickle.dumps(result))
        entry["command"] = "python -m bench.atlas" + ("" if len(sys.argv) == 1 else " " + shlex.join(sys.argv[1:]))
    html = atlas_page(result.to_dict(), {name: p.page_payload() for name, p in result.patterns.items()})
    path = RESULTS_DIR / f"atlas-{kind}.html"
    path.write_text(html, encoding="utf-8")
    entry["page_bytes"] = len(html.encode("utf-8"))
    entry["browser"] = page_in_chromium(path, result.n_layers * result.n_heads) | {"date": now(),
                                                                                    "load": load_average()}
    entry["summary"] = result.summary
    data.update({kind: entry, "machine": machine()})
    print("wrote", save_result("atlas", data))


if __name__ == "__main__":
    main()

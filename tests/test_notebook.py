"""probe's results in a real notebook: executed by nbclient in an IPython kernel, two classification and two ablation
outputs, then drawn in headless Chromium three ways: inserted into one page as JupyterLab does, each in an iframe of
its own as Colab does (plotly is not shared between them), and with JavaScript off as GitHub or nbviewer show them
(a static table of the top heads instead of empty plots)."""

from __future__ import annotations

import html
import time
from pathlib import Path
from typing import Any

import pytest

from test_browser import ARGS, CHROMIUM, browser  # noqa: F401  (the module's Chromium fixture)

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

TESTS = Path(__file__).parent
ROOT = TESTS.parent
pytestmark = pytest.mark.browser

CELLS = [
    f"import sys\nsys.path[:0] = [{str(ROOT)!r}, {str(TESTS)!r}]  # this checkout's probe, not an installed one\n"
    "from probe import classify, load_model\nfrom probe.ablation import sweep\nfrom probe.inputs import repeated_set\n"
    f"loaded = load_model({str(TESTS / 'planted.py')!r} + ':planted_textbook')\n"
    "probe_set = repeated_set(loaded, repeat_len=8, num_seqs=2)",
    "classify(loaded, seq_len=16, num_seqs=2, repeat_len=8)",
    "classify(loaded, seq_len=16, num_seqs=2, repeat_len=8, thresholds={'induction': 0.2})",
    "sweep(loaded, probe_set)",
    "sweep(loaded, probe_set, heads=[(0, 0), (1, 1), (1, 2)], method='mean')",
]
KINDS = ["classification", "classification", "ablation", "ablation"]
DRAWN = {"classification": ".probe-score-plot .heatmaplayer image", "ablation": ".probe-bar-plot .bars path"}


@pytest.fixture(scope="module")
def outputs() -> list[dict[str, str]]:
    """The four results' outputs (text/html and text/plain), from a notebook run by a real kernel."""
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in CELLS])
    nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}}).execute()
    found = []
    for cell in notebook.cells[1:]:
        results = [output for output in cell.outputs if output.output_type == "execute_result"]
        assert len(results) == 1, cell.outputs
        found.append(dict(results[0].data))
    return found


@pytest.mark.slow
def test_notebook_outputs_are_fragments_with_short_text(outputs: list[dict[str, str]]) -> None:
    for output, kind in zip(outputs, KINDS):
        fragment, text = output["text/html"], output["text/plain"]
        assert "<!doctype" not in fragment.lower() and "<meta" not in fragment.lower()
        assert f'data-kind="{kind}"' in fragment and 'class="probe-static"' in fragment
        assert len(text) < 300 and text.startswith("Classification(" if kind == "classification" else "AblationResult(")


def wait_drawn(frame: Any, selector: str, drawn: str, timeout: float = 60.0) -> None:
    """Poll until the output at `selector` says ready and plotly has drawn in it."""
    deadline = time.monotonic() + timeout
    script = (f"(() => {{ const e = document.querySelector({selector!r}); "
              f"return !!e && e.dataset.state === 'ready' && e.querySelectorAll({drawn!r}).length > 0; }})()")
    while not frame.evaluate(script):
        state = frame.evaluate(f"(document.querySelector({selector!r}) || {{dataset: {{}}}}).dataset.state")
        assert state != "error", frame.evaluate(f"document.querySelector({selector!r}).textContent")
        assert time.monotonic() < deadline, f"{selector} never drew (state {state})"
        time.sleep(0.1)


INSERT = """html => {
    const cell = document.createElement('div');
    cell.className = 'cell';
    document.body.appendChild(cell);
    cell.innerHTML = html;
    for (const old of Array.from(cell.querySelectorAll('script'))) {  // as JupyterLab runs an output's scripts
        const fresh = document.createElement('script');
        if (old.type) fresh.type = old.type;
        if (old.id) fresh.id = old.id;
        fresh.textContent = old.textContent;
        old.replaceWith(fresh);
    }
}"""


@pytest.mark.slow
def test_four_outputs_in_one_page_all_draw(outputs, browser, tmp_path: Path) -> None:  # noqa: F811
    path = tmp_path / "lab.html"
    path.write_text("<!DOCTYPE html><html><head><meta charset='utf-8'></head><body></body></html>", encoding="utf-8")
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(path.as_uri())
    for output in outputs:
        page.evaluate(INSERT, output["text/html"])
    for index, kind in enumerate(KINDS):
        wait_drawn(page, f".cell:nth-of-type({index + 1}) .probe-page", DRAWN[kind])
    ids = page.evaluate("Array.from(document.querySelectorAll('.probe-page')).map(e => e.id)")
    assert len(set(ids)) == 4
    assert page.evaluate("Array.from(document.querySelectorAll('.probe-static'))"
                         ".every(e => getComputedStyle(e).display === 'none')")  # the plots replaced the tables
    assert not errors, errors
    context.close()


@pytest.mark.slow
def test_each_output_in_its_own_iframe_draws(outputs, browser, tmp_path: Path) -> None:  # noqa: F811
    frames = "".join(f'<iframe style="width:1300px;height:900px" srcdoc="{html.escape(output["text/html"])}"></iframe>'
                     for output in outputs)
    path = tmp_path / "colab.html"
    path.write_text(f"<!DOCTYPE html><html><head><meta charset='utf-8'></head><body>{frames}</body></html>",
                    encoding="utf-8")
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.goto(path.as_uri())
    children = [frame for frame in page.frames if frame != page.main_frame]
    assert len(children) == 4
    for frame, kind in zip(children, KINDS):  # no plotly shared: each frame runs its own copy
        wait_drawn(frame, ".probe-page", DRAWN[kind])
        assert frame.evaluate("typeof window.Plotly") == "object"
    context.close()


def test_without_javascript_the_top_heads_show_as_a_table(outputs, browser, tmp_path: Path) -> None:  # noqa: F811
    path = tmp_path / "static.html"
    body = "".join(f"<div class='cell'>{output['text/html']}</div>" for output in outputs)
    path.write_text(f"<!DOCTYPE html><html><head><meta charset='utf-8'></head><body>{body}</body></html>",
                    encoding="utf-8")
    context = browser.new_context(java_script_enabled=False)
    page = context.new_page()
    page.goto(path.as_uri())
    tables = page.locator(".probe-static")
    assert tables.count() == 4 and all(tables.nth(i).is_visible() for i in range(4))
    ablation = tables.nth(2).inner_text()
    assert "Δ loss" in ablation and "1.1" in ablation  # the planted induction head matters most
    assert "induction" in tables.nth(0).inner_text()
    context.close()

"""The README's CLI tour runs as written: every command of its first bash block, in a fresh folder, on the default
model (slow: SmolLM2, loaded once for the session), with flags that shrink the inputs where the command has them
(bench/tour.py's SMALL; `python -m bench.tour` runs and times the tour as written). The inputs the tour names (a
classifier folder and its labelled texts, a training run's checkpoints) are made here first, the way a user would
have them (bench/tour.py's make_inputs). The README's Python block runs too, with small inputs."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from bench.tour import SMALL, make_inputs, python_block, quick_python, tour_lines
from conftest import run_cli
from probe.models import LoadedModel

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")


def tour() -> list[str]:
    """The commands of the README's `## CLI tour` bash block, comments dropped."""
    return [command for command, _ in tour_lines((ROOT / "README.md").read_text(encoding="utf-8"))]


def test_the_readme_cli_tour_runs_as_written(tmp_path: Path, capsys, monkeypatch, smollm2: LoadedModel) -> None:
    import probe.cli.options as options

    real = options.load_model
    monkeypatch.setattr(options, "load_model", lambda spec, **kwargs: smollm2 if spec == "smollm2" and not any(
        kwargs.get(name) for name in ("device", "device_map")) and kwargs.get("dtype") == "float32"
        else real(spec, **kwargs))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "160")
    make_inputs(tmp_path)
    commands = tour()
    assert len(commands) >= 12 and all(command.startswith("probe ") for command in commands)
    for command in commands:
        args = shlex.split(command)[1:]
        small = SMALL.get(args[0], []) if not {"--model", "-m"} & set(args) else []
        code, _, stderr = run_cli([*args, *small], capsys, monkeypatch)
        assert code == 0, f"{command}\n{stderr}"
        for flag in ("--json", "--csv", "--html"):
            if flag in args:
                assert (tmp_path / args[args.index(flag) + 1]).is_file(), f"{command}: no {flag} file"
    assert (tmp_path / "maps" / "smollm2" / "full_attention_heads.tsv").is_file()
    pages = sorted(tmp_path.glob("*.html"))
    written = {shlex.split(command)[index + 1] for command in commands
               for index, arg in enumerate(shlex.split(command)) if arg == "--html"}
    assert len(written) >= 7 and {page.name for page in pages} == written  # every --html the tour names, no other
    if CHROMIUM.exists():  # every page the tour wrote, laid out at both widths without a fault
        assert layout_faults(pages) == []


def layout_faults(pages: list[Path]) -> list[str]:
    """docs/_build/screenshots.py's measures (text past the right edge, an empty section, an axis label cut by its
    plot) of each page at 1000 and 1400 px in Chromium, and any script error; one line per fault."""
    import importlib.util

    from playwright.sync_api import sync_playwright

    spec = importlib.util.spec_from_file_location("screenshots", ROOT / "docs" / "_build" / "screenshots.py")
    assert spec is not None and spec.loader is not None
    screenshots = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(screenshots)
    faults: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                             args=["--no-sandbox", "--disable-gpu"])
        for path in pages:
            for width in screenshots.WIDTHS:
                page = browser.new_page(viewport={"width": width, "height": 900})
                page.on("pageerror", lambda error, name=path.name: faults.append(f"{name}: {error}"))
                page.goto(path.resolve().as_uri())
                faults += [f"{path.name} at {width} px: {fault}"  # the page's CSP refuses wait_for_function's eval
                           for fault in screenshots.layout_faults(page, path.stem)]
                page.close()
        browser.close()
    return faults


def test_the_readme_python_block_runs(monkeypatch, smollm2: LoadedModel) -> None:
    """The block as written, each call given small inputs (quick_python), on the session's SmolLM2."""
    import probe

    monkeypatch.setattr(probe, "load_model", lambda spec, **kwargs: smollm2 if spec == "smollm2" else
                        pytest.fail(f"the block loads {spec!r}"))
    code = quick_python(python_block((ROOT / "README.md").read_text(encoding="utf-8")))
    assert "num_seqs=1" in code and "fast=True" in code
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert {"result", "patterns", "swept"} <= set(namespace)
    assert len(namespace["swept"].results) == 270 and len(namespace["patterns"]) == 30  # every head; every layer

"""The documentation: the CLI reference is each command's own `--help`, the API reference covers the public API with
signatures and docstrings, the site builds strictly and offline, and the README stays short, saying nothing the site
does not."""

from __future__ import annotations

import html
import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import run_cli
from probe.cli.reference import WIDTH, command_help, command_names

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference"
PUBLIC = ("probe", "probe.ablation", "probe.inputs", "probe.syntax", "probe.patching", "probe.circuits")
"""The modules whose `__all__` is the public API: each function and class in it has a page entry."""
REQUIRED = ("probe.heads.scores.SCORES", "probe.heads.scores.register_score", "probe.inputs.PROBE_SETS",
            "probe.inputs.register_probe_set", "probe.ablation.methods.METHODS",
            "probe.ablation.methods.register_method",
            "probe.ablation.metrics.METRICS", "probe.ablation.metrics.register_metric",
            "probe.ablation.statistics.STATISTICS", "probe.circuits.pairs.circuits", "probe.ablation.prune.prune",
            "probe.kv.kv_heads", "probe.syntax.syntax_scores")
"""Beyond `__all__`: the registries and how to extend each, circuits, pruning."""


def directives() -> dict[str, list[str]]:
    """Each API page's `::: dotted.path` entries."""
    return {page.stem: re.findall(r"^::: ([\w.]+)$", page.read_text(encoding="utf-8"), re.M)
            for page in sorted(REFERENCE.glob("*.md"))}


def resolve(path: str) -> Any:
    """The object a dotted path names (the longest importable module, then attributes)."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            found = getattr(found, name)
        return found
    raise ImportError(path)


@pytest.mark.parametrize("name", [None, *command_names()])
def test_the_cli_reference_is_each_commands_help(name: str | None, capsys, monkeypatch) -> None:
    """What the site's CLI page shows for a command is what `probe COMMAND --help` prints (at the page's width)."""
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    code, stdout, _ = run_cli([name, "--help"] if name else ["--help"], capsys, monkeypatch)
    # run in-process, the program is named after pytest's module: the `probe` command names itself probe
    stdout = re.sub(r"Usage: python -m [\w.]*?(?=probe\b)", "Usage: ", stdout, count=1)
    printed = "\n".join(line.rstrip() for line in stdout.strip("\n").splitlines())
    assert code == 0 and printed == command_help(name)
    assert f"Usage: probe {name or ''}".rstrip() in printed


@pytest.mark.slow
def test_every_command_is_in_the_reference() -> None:
    from probe.cli.reference import markdown

    page = markdown()
    assert {"classify", "models", "heatmap", "ablate", "patch"} <= set(command_names())
    for name in command_names():
        assert f"## probe {name}\n" in page and command_help(name) in page


def test_the_api_pages_cover_the_public_api() -> None:
    """Every function and class of the public modules' `__all__`, and the registries, have an entry; every entry
    resolves and has a docstring."""
    entries = [path for paths in directives().values() for path in paths]
    assert len(entries) == len(set(entries)), "an entry is listed twice"
    documented = {id(resolve(path)) for path in entries}
    documented |= {id(member) for path in entries if inspect.ismodule(resolve(path))  # a module's entry: its own
                   for name, member in vars(resolve(path)).items() if not name.startswith("_")
                   and getattr(member, "__module__", None) == path}
    public = [f"{module}.{name}" for module in PUBLIC for name in importlib.import_module(module).__all__
              if inspect.isfunction(resolve(f"{module}.{name}")) or inspect.isclass(resolve(f"{module}.{name}"))]
    missing = [path for path in [*public, *REQUIRED] if id(resolve(path)) not in documented]
    assert not missing, missing
    undocumented = [path for path in entries if (inspect.isfunction(resolve(path)) or inspect.isclass(resolve(path)))
                    and not docstring(resolve(path))]
    assert not undocumented, undocumented


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as CI builds it: `mkdocs build --strict` (a broken link or a missing reference fails)."""
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("MkDocs is not installed: pip install -e '.[docs]'")
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr
    return out


def docstring(obj: Any) -> str:
    """The object's own docstring ('' where it has none: a dataclass' generated `Name(field, ...)` is none)."""
    doc = inspect.getdoc(obj) or ""
    return "" if inspect.isclass(obj) and doc.startswith(f"{obj.__name__}(") else doc


def text_of(page: Path) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text(encoding="utf-8")))


@pytest.mark.slow
def test_the_site_shows_each_entry_with_its_signature_and_docstring(site: Path) -> None:
    for stem, paths in directives().items():
        page = (site / "reference" / f"{stem}.html").read_text(encoding="utf-8")
        text = text_of(site / "reference" / f"{stem}.html")
        for path in paths:
            heading = page.find(f'id="{path}"')
            assert heading >= 0, f"{stem}: {path} has no heading"
            obj = resolve(path)
            if inspect.isfunction(obj) or inspect.isclass(obj):
                assert "doc-signature" in page[heading:heading + 3000], f"{stem}: {path} has no signature"
                first = docstring(obj).split("\n")[0]
                words = first.replace("`", "")[:30]
                assert words in text, f"{stem}: {path}'s docstring ({words!r}) is not on the page"
    cli = text_of(site / "reference/cli.html")  # the CLI reference page
    for name in command_names():
        assert command_help(name).splitlines()[1].strip() in cli  # its usage line
        assert all(line.strip() in cli for line in command_help(name).splitlines() if line.strip())


def test_the_home_page_is_the_readme(site: Path) -> None:
    home = text_of(site / "index.html")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for block in re.findall(r"```\w*\n(.*?)```", readme, re.S):
        for line in block.splitlines():
            assert html.unescape(line.strip()) in home, line
    assert (site / "images" / "heatmap.png").is_file() and 'src="images/heatmap.png"' in (
        site / "index.html").read_text(encoding="utf-8")


@pytest.mark.browser
def test_the_site_makes_no_request_outside_itself(site: Path) -> None:
    """Offline: the theme's fonts are off and no page loads anything from the network."""
    chromium = Path("/usr/bin/chromium")
    if not chromium.exists():
        pytest.skip(f"{chromium} is missing")
    from playwright.sync_api import sync_playwright

    from test_browser import ARGS

    requests: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(chromium), args=ARGS, headless=True)
        page = browser.new_page()
        page.on("request", lambda request: requests.append(request.url))
        for name in ("index.html", "reference/models.html", "reference/cli.html", "getting-started.html"):
            page.goto((site / name).as_uri())
            page.wait_for_load_state("load")
            assert page.locator("h1").count() >= 1
        browser.close()
    outside = [url for url in requests if not url.startswith(("file://", "data:", "blob:"))]
    assert requests and not outside, outside


def test_the_readme_is_short_and_keeps_its_two_commands() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 120
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    assert blocks[:2] == ["bash install.sh && .venv/bin/probe classify\n",
                          'bash install.sh --test && .venv/bin/python -m pytest -q -m "not slow"\n']
    ci = (ROOT / ".ci" / "run").read_text().splitlines()  # the README's command, with the linters between its halves
    assert ci.index("bash install.sh --test") < ci.index('.venv/bin/python -m pytest -q -m "not slow"') \
        < ci.index(".venv/bin/python -m pytest -q -m slow")  # and the tests that load SmolLM2
    picture = ROOT / "docs" / "images" / "heatmap.png"
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size < 300_000
    for target in re.findall(r"\]\(([^)#]+)", readme):
        assert target.startswith("http") or (ROOT / target).exists(), target
    tour = blocks[2].splitlines()
    assert {line.split()[1] for line in tour} == set(command_names())  # one line per command, every command


def test_the_class_lists_are_the_registrys() -> None:
    """README.md and docs/getting-started.md list the head classes between class-list markers, as
    docs/_build/class_lists.py generates them from SCORES and the classes scored outside it."""
    import importlib.util

    from probe.heads.scores import SCORES

    spec = importlib.util.spec_from_file_location("class_lists", ROOT / "docs" / "_build" / "class_lists.py")
    assert spec is not None and spec.loader is not None
    lists = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lists)
    kinds = []
    for name in lists.FILES:
        text = (ROOT / name).read_text(encoding="utf-8")
        kinds += [match.group("kind") for match in lists.REGION.finditer(text)]
        assert text == lists.generated(text), f"{name}: a class list differs; run python docs/_build/generate.py"
    assert sorted(kinds) == sorted(lists.KINDS)  # each list is in one of the files
    for name, score in SCORES.items():
        assert name.replace("_", "-") in lists.every_class()
        assert f"| `{name}` | {score.letter} |" in lists.table()
        assert (name.replace("_", "-") in lists.default_classes()) == score.by_default
    assert "syntactic" in lists.every_class() and "sep" in lists.default_classes()

"""The checked-in files made from a registry are what their generators make now: one command regenerates them all
(docs/_build/generate.py), and this test names it while any is stale."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _generate():
    spec = importlib.util.spec_from_file_location("generate", ROOT / "docs" / "_build" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_generated_file_is_stale() -> None:
    generate = _generate()
    stale = [str(path.relative_to(ROOT)) for path in generate.stale()]
    assert not stale, f"{', '.join(stale)} differ from the registry: run {generate.COMMAND}"


def test_a_stale_file_is_found(tmp_path: Path) -> None:
    """A class list edited by hand is stale, and regenerating puts the registry's back."""
    generate = _generate()
    path, generated = next((path, made) for path, made in generate.targets() if path.name == "README.md")
    text = path.read_text(encoding="utf-8")
    start = text.index("<!-- class-list:all -->") + len("<!-- class-list:all -->")
    edited = text[:start] + "hand-written heads" + text[text.index("<!-- /class-list -->", start):]
    assert generated(edited) != edited and generated(edited) == generated(text)

"""Every generated file, regenerated in one command: `python docs/_build/generate.py` (from any directory).

Each generator here fills regions of checked-in files from a registry: `class_lists.py` the head-class lists of
README.md and docs/getting-started.md (probe.heads.scores.SCORES), and `schema_page.py` docs/schemas.md's
schemas (probe.schemas.SCHEMAS). `tests/test_generated.py` fails, naming this command, while any file differs from
what its generator makes. The pages mkdocs fills at build time (the CLI reference, the home page, the API pages'
members) are not files here: `generated_pages.py` and mkdocstrings make them from the code each time.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
COMMAND = "python docs/_build/generate.py"


def _generator(name: str) -> ModuleType:
    """One generator module of this folder (a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"_build_{name}", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def targets() -> list[tuple[Path, Callable[[str], str]]]:
    """(file, its generator's `generated(text) -> text`) for every generated file."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    lists, schemas = _generator("class_lists"), _generator("schema_page")
    return [*[(ROOT / name, lists.generated) for name in lists.FILES], (schemas.PAGE, schemas.generated)]


def stale() -> list[Path]:
    """The generated files that differ from what their generator makes now."""
    return [path for path, generated in targets()
            if path.read_text(encoding="utf-8") != generated(path.read_text(encoding="utf-8"))]


def main() -> None:
    for path, generated in targets():
        text = path.read_text(encoding="utf-8") if path.exists() else ""
        fresh = generated(text)
        if fresh != text:
            path.write_text(fresh, encoding="utf-8")
            print(f"regenerated {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()

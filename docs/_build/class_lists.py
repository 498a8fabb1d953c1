"""The head-class lists of README.md and docs/getting-started.md, generated from the registry (probe.heads.scores
SCORES, then the classes scored outside it: `syntactic`). Each list sits between `<!-- class-list:KIND -->` and
`<!-- /class-list -->`; `python docs/_build/generate.py` rewrites them with every other generated file, and
tests/test_generated.py fails while a list differs from the registry.
"""

from __future__ import annotations

import re
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FILES = ("README.md", "docs/getting-started.md")
WIDTH = 120  # the docs' line length
REGION = re.compile(r"(<!-- class-list:(?P<kind>[a-z]+) -->)(?P<body>.*?)(<!-- /class-list -->)", re.DOTALL)


def _classes() -> list[tuple[str, dict]]:
    """(name, description) of every registered class, SCORES first, then those scored outside it."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from probe.heads.scores import SCORES
    from probe.syntax.result import SYNTACTIC, SYNTACTIC_CLASS

    scored = [(name, {**score.describe(), "default": score.by_default}) for name, score in SCORES.items()]
    return [*scored, (SYNTACTIC, {**SYNTACTIC_CLASS, "default": False, "default_threshold": None})]


def _words(names: list[str]) -> str:
    words = [name.replace("_", "-") for name in names]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


def every_class() -> str:
    """README: every class, in a sentence."""
    return f"{_words([name for name, _ in _classes()])} heads"


def default_classes() -> str:
    """getting-started: the classes `probe classify` scores without being asked."""
    return f"{_words([name for name, about in _classes() if about.get('default')])} heads"


def table() -> str:
    """getting-started: one row per class."""
    rows = ["", "", "| class | letter | what it means | probe set | label if | scored by default |",
            "| --- | --- | --- | --- | --- | --- |"]
    for name, about in _classes():
        threshold = about.get("default_threshold")
        label = "> the `--margin`" if threshold is None else f"> {threshold:g}"
        default = "yes" if about.get("default") else "no"
        rows.append(f"| `{name}` | {about['letter']} | {about['summary']} | {about['probe_set']} | {label} | "
                    f"{default} |")
    return "\n".join(rows) + "\n\n"


KINDS: dict[str, Callable[[], str]] = {"all": every_class, "default": default_classes, "table": table}


def _wrapped(text: str, column: int, end: str) -> str:
    """A sentence region's text broken into lines of at most WIDTH, its first line starting at `column` and its
    last one followed by the end marker (kept whole)."""
    glued = end.replace(" ", "\0")
    lines = textwrap.wrap(f"{text}{glued}", width=WIDTH, initial_indent="\0" * column, break_on_hyphens=False)
    return "\n".join(lines).replace("\0", " ")[column:-len(end)]


def generated(text: str) -> str:
    """`text` with every class-list region filled from the registry."""
    def fill(match: re.Match) -> str:
        body = KINDS[match.group("kind")]()
        if "\n" not in body:  # a sentence: wrapped like the prose around it
            column = match.start() - text.rfind("\n", 0, match.start()) - 1 + len(match.group(1))
            body = _wrapped(body, column, match.group(4))
        return f"{match.group(1)}{body}{match.group(4)}"

    return REGION.sub(fill, text)


def main() -> None:
    for name in FILES:
        path = ROOT / name
        text = path.read_text(encoding="utf-8")
        path.write_text(generated(text), encoding="utf-8")


if __name__ == "__main__":
    main()

"""User docs, docstrings and comments speak of the software, never of the work that made it: no issue numbers, no
"the issue", no sessions, engineers or worktrees. History (how a number came about, which run measured it) belongs
in bench/NOTES.md, which this test does not read.

The words, precisely:
- `issue N`, `issue #N`, `issues N` (a number of the tracker), `issue's` and `the issue` (the task text);
- `engineer(s)` and `worktree(s)`, in any sense;
- `session(s)`, unless named for what it is: an HTTP, interpreter, interactive, Jupyter, notebook, Python, shell, SSH
  or browser session (those are the software's own words; a work session is not).
Python files are read by their comments and strings only (an identifier such as a profiler's `session` is code, not
prose); Markdown, HTML, CSS and JavaScript whole, except vendored minified files (*.min.js) and data files.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("docs", "probe", "cli", "reports")
FILES = ("README.md", "bench/RESULTS.md")
SUFFIXES = {".md", ".py", ".js", ".html", ".css"}
QUALIFIED = {"http", "interpreter", "interactive", "jupyter", "notebook", "python", "shell", "ssh", "browser"}
WORDS = re.compile(r"\bissues?\s*#?\d+|\bissue's\b|\bthe issue\b|\bengineers?\b|\bworktrees?\b"
                   r"|(?:\b(?P<before>\w+)\s+)?\bsessions?\b", re.IGNORECASE)


def found(text: str) -> list[str]:
    """The words of the work in `text` (a session named for what it is is the software's)."""
    return [match.group(0) for match in WORDS.finditer(text)
            if (match.group("before") or "").lower() not in QUALIFIED or "session" not in match.group(0).lower()]


def _checked() -> list[Path]:
    found = [ROOT / name for name in FILES if (ROOT / name).is_file()]
    for folder in FOLDERS:
        found += [path for path in sorted((ROOT / folder).rglob("*"))
                  if path.suffix in SUFFIXES and not path.name.endswith(".min.js") and path.is_file()]
    return found


def _prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of what a reader reads: a Python file's comments and strings, any other file's lines."""
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".py":
        return list(enumerate(text.splitlines(), start=1))
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return [(token.start[0], token.string) for token in tokens if token.type in (tokenize.COMMENT, tokenize.STRING)]


def hits(path: Path) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line}: {word!r}" for line, text in _prose(path) for word in found(text)]


def test_docs_and_code_speak_of_the_software() -> None:
    found = [hit for path in _checked() for hit in hits(path)]
    assert not found, "the work, not the software (history goes to bench/NOTES.md):\n" + "\n".join(found)


def test_the_words_are_the_ones_meant(tmp_path: Path) -> None:
    """What is caught and what is not."""
    caught = ["as issue 44 asks", "issue #12", "the issue's target", "The issue names it", "a worktree",
              "other engineers' runs", "session 9", "a later session"]
    kept = ["an HTTP session", "the interactive session", "tissue", "a non-issue", "the KV cache's issues"]
    assert all(found(text) for text in caught)
    assert not any(found(text) for text in kept)
    code = tmp_path / "code.py"
    code.write_text('session = profiler.stop()  # fine\nx = "as the engineer wrote"\n', encoding="utf-8")
    assert [word for _, text in _prose(code) for word in found(text)] == ["engineer"]

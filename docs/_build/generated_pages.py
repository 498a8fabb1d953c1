"""mkdocs hook: the pages generated at build time.

- The CLI reference (`<!-- cli-reference -->`) is rendered from the typer app (probe.cli.reference): what
  `probe COMMAND --help` prints. It runs in a process of its own at the checkout's root, so that the checkout's probe
  is the one rendered, never an installed one (mkdocs' plugins may have imported that already).
- The home page (`<!-- readme -->`) is the README itself, its links into docs/ made links within the site: the
  README says nothing the site does not.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CLI_MARKER, README_MARKER = "<!-- cli-reference -->", "<!-- readme -->"
RENDER = "from probe.cli.reference import markdown; print(markdown(), end='')"


def cli_reference() -> str:
    """Every command's help as Markdown, from the checkout's own CLI."""
    done = subprocess.run([sys.executable, "-c", RENDER], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the CLI reference could not be generated: {done.stderr.strip()}")
    return done.stdout


def readme() -> str:
    """The README with its `docs/...` links (and picture) pointing within the site."""
    return re.sub(r"\]\(docs/", "](", (ROOT / "README.md").read_text(encoding="utf-8"))


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """Fill in the markers of the generated pages."""
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    if README_MARKER in markdown:
        markdown = markdown.replace(README_MARKER, readme())
    return markdown

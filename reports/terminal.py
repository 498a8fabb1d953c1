"""Terminal rendering with rich: readable reports of results computed elsewhere."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from probe.classify import Classification
from probe.scores import SCORES

LETTERS = {"previous_token": "P", "sink": "S", "induction": "I", "duplicate_token": "D", "next_token": "N",
           "positional": "O"}
MAX_ROWS = 20  # flagged heads listed per class; the JSON has every head


def classification_report(result: Classification, console: Console, *, max_rows: int = MAX_ROWS) -> None:
    """For each class, the flagged heads by score, then a layer x head overview of the labels."""
    console.print(Text(f"Head classification of {result.model}", style="bold"),
                  Text(f"({result.n_layers} layers x {result.n_heads} heads)"))
    for name, info in result.probe_sets.items():
        console.print(Text(f"  probe set {info.get('description', name)}", style="dim"))
    for name in result.scores:
        flagged = result.flagged(name)
        summary = SCORES[name].summary if name in SCORES else ""
        console.print()
        console.print(Text(f"{name} heads: {len(flagged)} with score > {result.thresholds[name]:g}", style="bold"),
                      Text(f"({summary})", style="dim"))
        if not flagged:
            console.print(Text("  none", style="dim"))
            continue
        table = Table(show_edge=False, pad_edge=False, box=None)
        table.add_column("layer.head", justify="right")
        table.add_column("score", justify="right")
        table.add_column("", no_wrap=True)
        for layer, head, score in flagged[:max_rows]:
            table.add_row(f"{layer}.{head}", f"{score:.3f}", Text("█" * round(score * 20), style="cyan"))
        console.print(table)
        if len(flagged) > max_rows:
            console.print(Text(f"  ... and {len(flagged) - max_rows} more (see --json)", style="dim"))
    console.print()
    console.print(overview(result))


def overview(result: Classification) -> Table:
    """Layer x head grid; each cell holds the letters of the head's labels."""
    legend = " ".join(f"{letter}={name}" for name, letter in LETTERS.items() if name in result.scores)
    table = Table(title=f"Overview, layer x head: {legend}", title_justify="left", show_edge=False,
                  pad_edge=False, box=None)
    table.add_column("layer", justify="right", style="dim")
    for head in range(result.n_heads):
        table.add_column(str(head), justify="center")
    for layer in range(result.n_layers):
        cells = []
        for head in range(result.n_heads):
            letters = "".join(LETTERS.get(name, name[0].upper()) for name in result.labels(layer, head))
            cells.append(Text(letters or "·", style="bold" if letters else "dim"))
        table.add_row(str(layer), *cells)
    return table


def key_values(console: Console, items: dict[str, Any]) -> None:
    for key, value in items.items():
        console.print(Text(f"{key}: ", style="bold"), Text(str(value)))

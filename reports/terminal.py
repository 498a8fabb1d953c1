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


PART_LABELS = {"first_repeat": "Δ 1st copy", "second_repeat": "Δ 2nd copy"}


def ablation_report(result: Any, console: Console, *, top: int = 15) -> None:
    """An AblationResult: what was run, the baseline, the heads whose removal hurts most and those whose removal
    helps (negative delta), and heads ablated together."""
    from probe.ablate import METRICS, label

    estimate = result.mode == "estimate"
    what = f"{result.method} ablation" + (" (estimated)" if estimate else "")
    console.print(Text(f"Head ablation of {result.model}", style="bold"),
                  Text(f"({result.n_layers} layers x {result.n_heads} heads, {what})"))
    description = result.probe_set.get("description", result.data) if result.probe_set else result.data
    console.print(Text(f"  data: {description}", style="dim"))
    console.print(Text(f"  metric: {result.metric}: {METRICS.get(result.metric, '')}", style="dim"))
    if result.mean:
        console.print(Text(f"  mean: {result.mean}", style="dim"))
    console.print(Text(f"  computed: {result.path}", style="dim"))
    parts = "".join(f", {name.replace('_', ' ')} {value:.4f}" for name, value in result.baseline_parts.items())
    cost = f", {result.forwards:.1f} forward-equivalents" if result.forwards is not None else ""
    seconds = f" ({result.seconds:.1f} s{cost})" if result.seconds is not None else ""
    console.print(Text("baseline loss: ", style="bold"), Text(f"{result.baseline_loss:.4f}{parts}{seconds}"))

    def table(title: str, rows: list[Any]) -> Table:
        grid = Table(title=title, title_justify="left", title_style="bold", show_edge=False, pad_edge=False)
        grid.add_column("head" if all(len(r.heads) == 1 for r in rows) else "heads", justify="right")
        grid.add_column("loss", justify="right")
        grid.add_column("delta", justify="right")
        for name in result.baseline_parts:
            grid.add_column(PART_LABELS.get(name, f"Δ {name}"), justify="right")
        if estimate:
            grid.add_column("", justify="left")
        grid.add_column("", no_wrap=True)
        scale = max((abs(r.delta) for r in rows), default=0.0) or 1.0
        for r in rows:
            cells = [label(r.heads), f"{r.loss:.4f}", f"{r.delta:+.4f}"]
            cells += [f"{r.part_deltas[name]:+.4f}" if r.part_deltas.get(name) is not None else ""
                      for name in result.baseline_parts]
            if estimate:
                cells.append("exact" if r.exact else "est.")
            bar = Text("█" * max(1, round(abs(r.delta) / scale * 20)) if r.delta else "",
                       style="red" if r.delta > 0 else "blue")
            grid.add_row(*cells, bar)
        return grid

    singles = sorted(result.heads, key=lambda r: (-r.delta, r.heads))
    if singles:
        console.print()
        console.print(table(f"Heads whose removal hurts most (largest delta, {min(top, len(singles))} of "
                            f"{len(singles)})", singles[:top]))
        helping = [r for r in reversed(singles) if r.delta < 0][:top]
        console.print()
        if helping:
            console.print(table("Heads whose removal helps (most negative delta)", helping))
        else:
            console.print(Text("No head lowers the loss when removed.", style="dim"))
    if result.groups:
        console.print()
        console.print(table("Heads ablated together", sorted(result.groups, key=lambda r: -r.delta)))

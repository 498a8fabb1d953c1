"""Terminal report and CSV rows of `Attribution.to_dict()` (probe dla): the heads that write the logit difference
directly, the other components, and the decomposition's identity check."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from probe.reports.labels import column_label, short_label

SHOWN_POSITIONS = 4  # source positions named for the top head


def dla_rows(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per head (largest |DLA| first): for CSV."""
    return [{"rank": rank, "name": column_label(entry["layer"], entry["head"]), "layer": entry["layer"],
             "head": entry["head"], "dla": entry["dla"]} for rank, entry in enumerate(payload["heads"], start=1)]


def _sources(payload: dict[str, Any]) -> Text | None:
    """The top head's largest shares by source position, on the first pair."""
    per_position = payload.get("per_position")
    if not per_position or not per_position["points"]:
        return None
    head, point = per_position["heads"][0], per_position["points"][0]
    values = point["values"][0]
    order = sorted(range(len(values)), key=lambda index: -abs(values[index]))[:SHOWN_POSITIONS]
    listed = ", ".join(f"{point['tokens'][index]!r} {values[index]:+.3f}" for index in order)
    return Text(f"{short_label(head['layer'], head['head'])} by source position on the first pair "
                f"({''.join(point['tokens'])!r}): {listed}", style="dim")


def dla_report(payload: dict[str, Any], console: Console, *, top: int = 15) -> None:
    """The `top` heads by |DLA| (mean over points), the scores and the identity's residual."""
    corrupt = payload["logit_diff_corrupt"]
    header = f"{payload['metric']} {payload['logit_diff']:+.3f} (clean)" + (
        "" if corrupt is None else f", {corrupt:+.3f} (corrupt)")
    console.print(Text(f"Direct logit attribution of {payload['model']}", style="bold"),
                  Text(f"({payload['source']}; {payload['points']} points; {header})"))
    table = Table(show_edge=False, pad_edge=False, box=None)
    for column in ("rank", "head", "DLA", f"share of {payload['logit_diff']:+.3f}"):
        table.add_column(column, justify="right")
    for rank, entry in enumerate(payload["heads"][:top], start=1):
        share = entry["dla"] / payload["logit_diff"] if payload["logit_diff"] else float("nan")
        table.add_row(str(rank), short_label(entry["layer"], entry["head"]), f"{entry['dla']:+.3f}", f"{share:+.1%}")
    console.print(table)
    parts = payload["components"]
    console.print(Text(f"heads {parts['heads']:+.3f}, MLPs {sum(parts['mlps']):+.3f}, embeddings "
                       f"{parts['embeddings']:+.3f}, attention biases {parts['attention_biases']:+.3f}, final biases "
                       f"{parts['final_bias']:+.3f}: sum {payload['identity']['sum']:+.3f}; largest |sum - model's "
                       f"own| {payload['identity']['max_residual']:.2e}", style="bold"))
    sources = _sources(payload)
    if sources is not None:
        console.print(sources)
    note = "before soft-capping; " if payload["capped"] else ""
    console.print(Text(f"DLA: {note}each component through the final norm, its scale frozen at the clean run, "
                       "dotted with W_U[answer] - W_U[distractor]", style="dim"))

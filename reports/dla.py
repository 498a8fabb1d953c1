"""`probe dla`'s terminal report, CSV rows and page, from `Attribution.to_dict()` (with its `self_repair`)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.text import Text

from probe.reports.html import asset_script, esc, facts_table, grid_axes, page, rounded_grid
from probe.reports.terminal import table
from probe.reports.labels import column_label, precision_note, short_label
from probe.reports.selfrepair import TOP, self_repair_grid, self_repair_html, self_repair_report

SHOWN_POSITIONS = 4  # source positions named for the top head


def dla_rows(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per head (largest |DLA| first): for CSV."""
    section = payload.get("self_repair")
    repair = {(row["layer"], row["head"]): row for row in (section["heads"] if section else [])}
    return [{"rank": rank, "name": column_label(entry["layer"], entry["head"]), "layer": entry["layer"],
             "head": entry["head"], "dla": entry["dla"]} | _repair_columns(repair.get((entry["layer"], entry["head"])))
            for rank, entry in enumerate(payload["heads"], start=1)]


def _repair_columns(row: dict[str, Any] | None) -> dict[str, Any]:
    """A head's self-repair numbers for its CSV row (nothing where self-repair was not measured)."""
    if row is None:
        return {}
    return {"total": row["total"], "direct": row["direct"], "self_repair": row["self_repair"],
            "covered_by": " ".join(column_label(entry["layer"], entry["head"]) for entry in row["compensating"])}


def _sources(payload: dict[str, Any]) -> Text | None:
    """The top head's largest shares by source position, on the first pair."""
    per_position = payload.get("per_position")
    if not per_position or not per_position["points"]:
        return None
    head, point = per_position["heads"][0], per_position["points"][0]
    values = point["values"][0]
    order = sorted(range(len(values)), key=lambda index: -abs(values[index]))[:SHOWN_POSITIONS]
    listed = ", ".join(f"{point['tokens'][index]!r} at position {index} {values[index]:+.3f}" for index in order)
    return Text(f"{short_label(head['layer'], head['head'])} by source position on the first pair "
                f"({''.join(point['tokens'])!r}): {listed}", style="dim")


def dla_report(payload: dict[str, Any], console: Console, *, top: int = 15) -> None:
    """The `top` heads by |DLA| (mean over points), the scores and the identity's residual."""
    corrupt = payload["logit_diff_corrupt"]
    header = f"{payload['metric']} {payload['logit_diff']:+.3f} (clean)" + (
        "" if corrupt is None else f", {corrupt:+.3f} (corrupt)")
    console.print(Text(f"Direct logit attribution of {payload['model']}", style="bold"),
                  Text(f"({payload['source']}; {payload['points']} points; {header})"))
    grid = table("rank", "head", "DLA", f"share of {payload['logit_diff']:+.3f}")
    for rank, entry in enumerate(payload["heads"][:top], start=1):
        share = entry["dla"] / payload["logit_diff"] if payload["logit_diff"] else float("nan")
        grid.add_row(str(rank), short_label(entry["layer"], entry["head"]), f"{entry['dla']:+.3f}", f"{share:+.1%}")
    console.print(grid)
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
    bound = payload["identity"].get("rounding_bound")
    within = "" if bound is None else f"; the model's own rounding allows |sum - model's own| up to {bound:.2e}"
    if precision_note(payload):
        console.print(Text(precision_note(payload) + within, style="dim"))
    if payload.get("self_repair"):
        self_repair_report(payload["self_repair"], console, top=top)


def dla_page(payload: dict[str, Any], *, top: int = TOP) -> str:
    """`probe dla --html`: the maps of DLA (and self-repair) and the self-repair table."""
    repair = payload.get("self_repair")
    rows = [("model", str(payload["model"])), ("data", str(payload["source"])),
            ("metric", f"{payload['metric']}: {payload['logit_diff']:+.4f} clean"),
            ("identity", f"sum of shares {payload['identity']['sum']:+.4f}, largest |sum - model's own| "
                         f"{payload['identity']['max_residual']:.2e}")]
    data = {**grid_axes(payload["n_layers"], payload["n_heads"]), "dla": rounded_grid(payload, payload["heads"], "dla"),
            "self_repair": None if not repair else self_repair_grid(repair)}
    body = (f"<h1>Direct logit attribution of {esc(payload['model'])}</h1>" + facts_table(rows)
            + '<div class="probe-row"><div class="probe-grow"><h2>Direct logit attribution per head (clean run)</h2>'
            '<div class="probe-dla-grid"></div></div>'
            + ("" if not repair else '<div class="probe-grow"><h2>Self-repair per head</h2>'
               '<div class="probe-dla-repair"></div></div>') + "</div>"
            + ("" if not repair else self_repair_html(repair, top=top))
            + asset_script("dla.js"))
    return page("dla", f"probe dla: {payload['model']}", body, data, embed_plotly=True)

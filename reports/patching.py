"""`probe patch`'s terminal report, CSV rows and page, from `PatchResult.to_dict()` (with DLA, classes and
self-repair where the command added them)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.text import Text

from probe.errors import ProbeError
from probe.reports.html import esc, facts_table, grid_axes, page, plotly_text, ranked_table, rounded_grid
from probe.reports.terminal import table
from probe.reports.labels import column_label, long_label, precision_clause, short_label
from probe.reports.selfrepair import self_repair_html, self_repair_report

TOP = 15  # heads in the terminal table and in the by-position view
HEADER = ["head", "patch effect", "LD patched", "DLA", "classes"]


def _rows(payload: dict[str, Any]) -> list[dict[str, Any]]:
    rows = payload.get("heads")
    if not isinstance(rows, list) or not rows:
        raise ProbeError("patching result has no heads to show")
    return rows


def ranked(payload: dict[str, Any], top: int = TOP) -> list[dict[str, Any]]:
    """The `top` head rows by |patch effect| (a key/value group's query heads once: the group's first)."""
    rows = [row for row in _rows(payload) if row.get("kv_head") is None or row["head"] == min(
        other["head"] for other in _rows(payload) if other["layer"] == row["layer"]
        and other.get("kv_head") == row["kv_head"])]
    return sorted(rows, key=lambda row: (-abs(row["patch_effect"]), row["layer"], row["head"]))[:top]


def patch_rows(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """One CSV row per head: its numbers, and its classes joined by spaces."""
    names = payload.get("layer_names")
    return [{"name": column_label(row["layer"], row["head"], names)}
            | {key: value for key, value in row.items() if key != "classes"}
            | {"classes": " ".join(row.get("classes", []))} for row in _rows(payload)]


def _unit(row: dict[str, Any], payload: dict[str, Any]) -> str:
    name = short_label(row["layer"], row["head"], payload.get("layer_names"))
    return name if row.get("kv_head") is None else f"{row['layer']}.kv{row['kv_head']} (from {name})"


def _ranked_cells(payload: dict[str, Any], top: int) -> list[list[str]]:
    """The top heads by |patch effect|, in HEADER's columns: the terminal's table and the page's."""
    return [[_unit(row, payload), f"{row['patch_effect']:+.3f}", f"{row['logit_diff']:+.3f}",
             "" if row.get("dla") is None else f"{row['dla']:+.3f}", ", ".join(row.get("classes", []))]
            for row in ranked(payload, top)]


def patch_report(payload: dict[str, Any], console: Console, *, top: int = TOP) -> None:
    """The runs' logit differences, then the top heads by patch effect with their DLA and classes."""
    console.print(Text(f"Activation patching of {payload['model']}: {payload['component']}, {payload['direction']}",
                       style="bold"), Text(f"({payload['data']})", style="dim"))
    console.print(f"  logit difference: clean {payload['clean_logit_diff']:+.3f}, corrupt "
                  f"{payload['corrupt_logit_diff']:+.3f}; patch effect 1 = the clean behaviour, 0 = the corrupt one")
    console.print(table(*HEADER, left=("classes",), rows=_ranked_cells(payload, top)))
    console.print(Text(f"  {payload['path']}; {payload['seconds']:.1f} s{precision_clause(payload)}", style="dim"))
    if payload.get("paths"):
        path_report(payload["paths"], console)
    if payload.get("self_repair"):
        self_repair_report(payload["self_repair"], console, top=top)


def _receiver(receiver: list[int] | str) -> str:
    """A receiver's column name: a head's LAYER.HEAD, or the logits (the direct path)."""
    return receiver if isinstance(receiver, str) else f"{receiver[0]}.{receiver[1]}"


def path_report(paths: dict[str, Any], console: Console) -> None:
    """The sender x receiver matrix of path patching's effects."""
    console.print(Text("Path patching: each sender's direct path into the logits" if paths["component"] == "logits"
                       else f"Path patching: each sender's effect through the receivers' {paths['component']}",
                       style="bold"))
    grid = table("sender \\ receiver", *(_receiver(receiver) for receiver in paths["receivers"]))
    for (layer, head), row in zip(paths["senders"], paths["patch_effect"]):
        grid.add_row(f"{layer}.{head}", *(f"{value:+.3f}" for value in row))
    console.print(grid)


def _by_position(payload: dict[str, Any], top: int) -> dict[str, Any] | None:
    """The top heads' patch effect at each position (heads down, positions across), or None without it."""
    entries = payload.get("by_position") or []
    if not entries:
        return None
    chosen = [(row["layer"], row["head"]) for row in ranked(payload, top)]
    effect = {(tuple(entry["heads"][0]), entry["position"]): entry["patch_effect"] for entry in entries}
    positions = sorted({entry["position"] for entry in entries})
    tokens = payload.get("tokens") or []
    return {"z": [[effect.get((head, position)) for position in positions] for head in chosen],
            "heads": [short_label(layer, head, payload.get("layer_names")) for layer, head in chosen],
            "x": [plotly_text(f"{position}: {tokens[position]}") if position < len(tokens) else str(position)
                  for position in positions]}


def _paths(payload: dict[str, Any]) -> dict[str, Any] | None:
    paths = payload.get("paths")
    if not paths:
        return None
    return {"z": [[round(value, 6) for value in row] for row in paths["patch_effect"]],
            "x": [_receiver(receiver) for receiver in paths["receivers"]],
            "y": [f"{layer}.{head}" for layer, head in paths["senders"]], "component": paths["component"]}


def patch_data(payload: dict[str, Any], top: int = TOP) -> dict[str, Any]:
    names = payload.get("layer_names")
    return {**grid_axes(payload["n_layers"], payload["n_heads"]), "layer_names": names,
            "effect": rounded_grid(payload, _rows(payload), "patch_effect"),
            "dla": rounded_grid(payload, _rows(payload), "dla") if any(
                row.get("dla") is not None for row in _rows(payload)) else None,
            "by_position": _by_position(payload, top), "paths": _paths(payload),
            "top": [long_label(row["layer"], row["head"], names) for row in ranked(payload, top)]}


def patch_page(payload: dict[str, Any], *, embed_plotly: bool = True, top: int = TOP) -> str:
    """The top heads beside the maps of patch effect and DLA, then what else the run measured."""
    data = patch_data(payload, top)
    rows = [("model", str(payload["model"])), ("data", str(payload["data"])),
            ("patched", f"each head's {payload['component']}, {payload['direction']}"),
            ("logit difference", f"clean {payload['clean_logit_diff']:+.4f}, corrupt "
                                 f"{payload['corrupt_logit_diff']:+.4f}"),
            ("patch effect", "(LD patched - LD corrupt) / (LD clean - LD corrupt): 1 = the clean behaviour"),
            ("computed", str(payload["path"]))]
    shown = len(ranked(payload, top))
    body = (f"<h1>Activation patching of {esc(payload['model'])}</h1>" + facts_table(rows)
            + '<div class="probe-section"><div class="probe-row">'
            f'<div class="probe-grow"><h2>Top {shown} heads by |patch effect|</h2>'
            + ranked_table(HEADER, _ranked_cells(payload, top), text=(len(HEADER) - 1,)) + "</div>"
            + '<div class="probe-grow"><h2>Patch effect</h2><div class="probe-patch-effect"></div></div>'
            + ('<div class="probe-grow"><h2>Direct logit attribution (clean run)</h2>'
               '<div class="probe-patch-dla"></div></div>' if data["dla"] is not None else "")
            + "</div></div>"
            + ('<div class="probe-section"><h2>By position: the top heads</h2><div class="probe-patch-position"></div>'
               "</div>" if data["by_position"] is not None else "")
            + ('<div class="probe-section"><h2>Path patching: senders (down) through receivers (across)</h2>'
               '<div class="probe-patch-paths"></div></div>' if data["paths"] is not None else "")
            + (self_repair_html(payload["self_repair"], top=top) if payload.get("self_repair") else ""))
    return page("patch", f"probe patch: {payload['model']}", body, data, embed_plotly=embed_plotly)

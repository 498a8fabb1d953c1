"""`probe compare`'s terminal summary, CSV rows and page, from `Comparison.to_dict()`."""

from __future__ import annotations

from pathlib import PurePath
from typing import Any, Literal

from rich.console import Console
from rich.text import Text

from probe.reports.html import (asset_script, esc, facts_table, grid_axes, head_grid, page, plotly_text, ranked_table,
                                static_summary)
from probe.reports.labels import column_label, number
from probe.reports.terminal import table

LISTED = 15  # heads listed in the terminal, largest |B - A| first


def _unit(payload: dict[str, Any]) -> str:
    return "KV head" if payload["convention"] == "kv" else "head"


def _head(payload: dict[str, Any], layer: int, head: int) -> str:
    """`18.6` (query heads) or `18.kv2` (KV heads): which kind of head a row is, always said."""
    return f"{layer}.{'kv' if payload['convention'] == 'kv' else ''}{head}"


def _describe(side: dict[str, Any]) -> str:
    """One map in words: file, format, score, what a value belongs to, dtype and model where the file says."""
    unit = "KV heads" if side["convention"] == "kv" else "query heads"
    extra = [f"{side['dtype']}" if side["dtype"] else "", f"model {side['model']}" if side["model"] else ""]
    holds = f"{side['quantity']} ({side['unit']})" if side.get("quantity") and side.get("unit") else \
        side.get("quantity") or "a score its file does not name"
    facts = ", ".join(part for part in (side["format"], f"score {side['score']}", holds, f"{side['columns']} {unit}",
                                       *extra) if part)
    return f"{side['source']} ({facts})"


def short_names(a: str, b: str) -> tuple[str, str]:
    """The ends of the two paths that tell them apart (`run1/map.json`): two whole paths would wrap the title."""
    parts_a, parts_b = PurePath(a).parts, PurePath(b).parts
    keep = 1  # one file read twice (two --score) is named once each
    while parts_a != parts_b and parts_a[-keep:] == parts_b[-keep:]:
        keep += 1
    return str(PurePath(*parts_a[-keep:])), str(PurePath(*parts_b[-keep:]))


def summary_lines(payload: dict[str, Any]) -> list[str]:
    """The comparison in sentences: what was compared, the correlations, and the overlaps."""
    top = payload["top_k"]
    lines = [f"A: {_describe(payload['a'])}", f"B: {_describe(payload['b'])}"]
    if payload["conversion"]:
        lines.append(f"Converted: {payload['conversion']}.")
    differences = (f", mean |B - A| {payload['mean_abs_difference']:.4f}, largest "
                   f"{payload['max_abs_difference']:.4f}" if by_difference(payload) else "")
    lines.append(f"{payload['heads']} {_unit(payload)}s compared ({payload['n_layers']} layers x "
                 f"{payload['heads_per_layer']}): Spearman {number(payload['spearman'], '.4f')}, Pearson "
                 f"{number(payload['pearson'], '.4f')}{differences}.")
    if not by_difference(payload):
        lines.append(ranks_sentence(payload))
    lines.append(f"Top {top['k']}: {top['count']} in both (Jaccard {number(top['jaccard'], '.2f')}); only A: "
                 f"{_heads(payload, top['only_a'])}; only B: {_heads(payload, top['only_b'])}.")
    labelled = payload["labelled"]
    if labelled:
        lines.append(f"Labelled ({labelled['a']} in A: {labelled['count_a']}, {labelled['b']} in B: "
                     f"{labelled['count_b']}): {labelled['count']} in both (Jaccard "
                     f"{number(labelled['jaccard'], '.2f')}); only A: {_heads(payload, labelled['only_a'])}; only B: "
                     f"{_heads(payload, labelled['only_b'])}.")
    lines.append(precision_line(payload))
    return lines


def by_difference(payload: dict[str, Any]) -> bool:
    """Whether the maps hold one kind of score, so that B - A is shown (else their ranks are compared)."""
    return payload.get("measure", "difference") == "difference"


def ranks_sentence(payload: dict[str, Any]) -> str:
    """Why there is no B - A: the two maps measure different things."""
    kinds = [payload[side].get("quantity") or "a score its file does not name" for side in ("a", "b")]
    return (f"A holds {kinds[0]}, B {kinds[1]}: not one kind of score, so no B - A; compared by rank (1: largest; "
            "rank B - rank A below zero: B ranks the head higher).")


def _columns(payload: dict[str, Any]) -> tuple[list[str], str]:
    """The ranked table's header (heads as `layer.head` or `layer.kv`) and what it ranks by: B - A, or ranks."""
    heads = f"layer.{'kv' if payload['convention'] == 'kv' else 'head'}"
    if by_difference(payload):
        return [heads, "A", "B", "B - A", "rank A", "rank B"], "B - A"
    return [heads, "A", "B", "rank A", "rank B", "rank B - rank A"], "rank B - rank A"


def _cells(payload: dict[str, Any], row: dict[str, Any]) -> list[str]:
    """One ranked row as text, in `_columns`' order."""
    values, ranked = [number(row["a"], ".4f"), number(row["b"], ".4f")], [str(row["rank_a"]), str(row["rank_b"])]
    if by_difference(payload):
        return [_head(payload, row['layer'], row['head']), *values, f"{row['difference']:+.4f}", *ranked]
    return [_head(payload, row['layer'], row['head']), *values, *ranked, f"{row['rank_difference']:+d}"]


def precision_line(payload: dict[str, Any]) -> str:
    """What each map was computed in, where its file says."""
    said = [f"{side.upper()} computed in {dtype}" if dtype else f"{side.upper()}'s file states no dtype"
            for side, dtype in payload["dtypes"].items()]
    return "; ".join(said) + " (docs/precision.md: how far half precision lies from float32)."


def _heads(payload: dict[str, Any], cells: list[list[int]], shown: int = 8) -> str:
    names = [_head(payload, layer, head) for layer, head in cells]
    return "none" if not names else " ".join(names[:shown]) + (f" and {len(names) - shown} more"
                                                               if len(names) > shown else "")


def compare_report(payload: dict[str, Any], console: Console, *, listed: int = LISTED) -> None:
    """The summary lines and the heads whose value moved most (B - A)."""
    lines = summary_lines(payload)
    console.print(Text(lines[0], style="bold"))
    console.print(Text(lines[1], style="bold"))
    for line in lines[2:-1]:
        console.print(Text(line))
    header, by = _columns(payload)
    console.print(table(*header, pad_edge=True, title_justify="left", rows=(
        _cells(payload, row) for row in payload["movers"][:listed]),
        title=f"Largest differences ({by}), {min(listed, len(payload['movers']))} of {payload['heads']}"))
    console.print(Text(lines[-1], style="dim"))


def compare_rows(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """One CSV row per head, named `L5H1` (`L5KV1` over KV heads)."""
    kv = payload["convention"] == "kv"
    return [{"name": column_label(row["layer"], row["head"], kv=kv), **row} for row in payload["rows"]]


def _grid(payload: dict[str, Any],
          key: Literal["a", "b", "difference", "rank_difference"]) -> list[list[float | None]]:
    return head_grid(payload["n_layers"], payload["heads_per_layer"],
                     ((row["layer"], row["head"], row[key]) for row in payload["rows"]))


def _scale(side: dict[str, Any], name: str) -> dict[str, Any]:
    """How the page draws one map: its own colour scale, its unit, centred on 0 where its values are signed."""
    return {"title": name, "unit": plotly_text(side.get("unit") or "value"), "signed": bool(side.get("signed"))}


def compare_page(payload: dict[str, Any], *, listed: int = LISTED) -> str:
    """`probe compare --html`: maps A, B and B - A (rank B - rank A for different kinds of score), each on its own
    scale, and the largest differences."""
    facts = [("A", _describe(payload["a"])), ("B", _describe(payload["b"])),
             *((("converted", payload["conversion"]),) if payload["conversion"] else ()),
             *(("" if index else "summary", line) for index, line in
               enumerate(line for line in summary_lines(payload)[2:] if not line.startswith("Converted")))]
    unit = _unit(payload)
    movers = payload["movers"][:listed]
    header, by = _columns(payload)
    table = [_cells(payload, row) for row in movers]
    ranked = f'<div class="probe-movers">{ranked_table(header, table)}</div>'  # numbers right-aligned
    third: Literal["difference", "rank_difference"] = "difference" if by_difference(payload) else "rank_difference"
    data = {**grid_axes(payload["n_layers"], payload["heads_per_layer"]), "unit": unit,
            "a": _grid(payload, "a"), "b": _grid(payload, "b"), "third": _grid(payload, third),
            "scales": {"a": _scale(payload["a"], "A"), "b": _scale(payload["b"], "B"),
                       "third": {"title": by, "signed": True, "unit": plotly_text(payload["a"].get("unit") or "value")
                                 if third == "difference" else "places"}}}
    name_a, name_b = short_names(payload["a"]["source"], payload["b"]["source"])
    note = "" if by_difference(payload) else f'<p class="probe-note">{esc(ranks_sentence(payload))}</p>'
    body = (f"<h1>{esc(name_a)} against {esc(name_b)}</h1>" + facts_table(facts)
            + static_summary("Largest differences", header, table[:5])
            + f"<h2>A, B and {esc(by)} per {esc(unit)}</h2>" + note
            + "<p>Each map on its own colour scale, in its own unit; signed values on a scale centred on 0.</p>"
            '<div class="probe-row">'
            '<div><div class="probe-plot-title">A</div><div class="probe-compare-a"></div></div>'
            '<div><div class="probe-plot-title">B</div><div class="probe-compare-b"></div></div>'
            f'<div><div class="probe-plot-title">{esc(by)}</div><div class="probe-compare-third"></div></div></div>'
            f"<h2>Largest differences ({esc(by)}), {len(movers)} of {payload['heads']}</h2>" + ranked
            + asset_script("compare.js"))
    return page("compare", f"probe compare: {payload['a']['source']} vs {payload['b']['source']}", body, data,
                embed_plotly=True)

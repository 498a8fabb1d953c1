"""`probe kv-heads`'s terminal report and page, from `KVHeads.to_dict()` (the exports are probe.headmaps')."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from probe.reports.html import esc, facts_table, head_grid, page, plotly_text, ranked_table
from probe.reports.terminal import print_precision, table
from probe.reports.labels import long_label, short_label

LISTED = 15  # full KV heads listed in the terminal; the JSON has all
FULL = ["layer.kv", "retrieval", "streaming", "rank"]


def _full(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """The KV heads kept full, those retrieval needs most first."""
    return sorted((row for row in payload["kv_heads"] if row["label"] == "full"), key=lambda r: -r["rank"])


def _full_cells(full: list[dict[str, Any]]) -> list[list[str]]:
    """The first LISTED full KV heads in FULL's columns: the terminal's table and the page's."""
    return [[short_label(row["layer"], row["kv_head"]), f"{row['retrieval']:.3f}", f"{row['streaming']:.3f}",
             str(row["rank"])] for row in full[:LISTED]]


def kv_heads_report(payload: dict[str, Any], console: Console) -> None:
    """The model's needle accuracy, the KV heads kept full, and the curve."""
    total = payload["n_layers"] * payload["n_kv_heads"]
    console.print(Text(f"KV heads of {payload['model']}", style="bold"),
                  Text(f"({payload['n_layers']} layers x {payload['n_kv_heads']} KV heads, "
                       f"{payload['n_heads'] // payload['n_kv_heads']} query heads each; sink {payload['sink']} + "
                       f"recent {payload['recent']})"))
    console.print(table("length", "depth", "prompts", "all key tokens", "key tokens", pad_edge=True,
                        title="The model's own needle accuracy (teacher-forced, scored prompts)", title_justify="left",
                        rows=([str(row["length"]), f"{row['depth']:g}", str(row["prompts"]), f"{row['accuracy']:.2f}",
                               f"{row['token_accuracy']:.2f}"] for row in payload["needle_accuracy"])))
    full = _full(payload)
    console.print(Text(f"\n{payload['n_streaming']} of {total} KV heads stream, {len(full)} stay full "
                       f"(retrieval: max over the group; streaming: min)", style="bold"))
    console.print(table(*FULL, pad_edge=True, rows=_full_cells(full)))
    if len(full) > LISTED:
        console.print(Text(f"  ... and {len(full) - LISTED} more (see --json)", style="dim"))
    for line in budget_lines(payload.get("budget")):
        console.print(Text(line))
    curve = payload.get("curve")
    if curve:
        console.print(curve_table(curve))
        for name, k in (curve.get("stopped") or {}).items():
            console.print(Text(f"  {name.replace('_', ' seed ')} stopped at k = {k}: refused where probe's order is "
                               "kept (--every-random-point measures the rest)", style="dim"))
    if payload.get("seconds"):
        stages = ", ".join(f"{stage} {seconds:.0f} s" for stage, seconds in payload["seconds"].items())
        console.print(Text(f"Time per stage: {stages}.", style="dim"))
    print_precision(payload, console)


def curve_table(curve: dict[str, Any]) -> Table:
    """k streamed KV heads: loss change and needle accuracy for probe's order and the mean of the random ones."""
    randoms = [name for name in curve["orders"] if name != "probe"]
    grid = table("k", "Δ loss probe", "Δ loss random", "needle probe", "needle random", pad_edge=True,
                 title=f"Streaming the first k KV heads (baseline loss {curve['baseline_loss']:.4f}, needle accuracy "
                       f"{curve['baseline_needle_accuracy']:.2f}; random: mean of {len(randoms)} orders)",
                 title_justify="left")
    ours = curve["orders"]["probe"]
    for index, k in enumerate(curve["k"]):
        def mean(key: str, form: str) -> str:
            values = [value for name in randoms  # `index`: called within this iteration only
                      if (value := curve["orders"][name][key][index]) is not None]
            measured = f"{sum(values) / len(values):{form}}" if values else "stopped"
            return measured + (f" ({len(values)} of {len(randoms)})" if values and len(values) < len(randoms) else "")
        grid.add_row(str(k), f"{ours['loss_change'][index]:+.4f}", mean("loss_change", "+.4f"),
                     f"{ours['needle_accuracy'][index]:.2f}", mean("needle_accuracy", ".2f"))
    return grid


def budget_lines(budget: dict[str, Any] | None) -> list[str]:
    """The terminal lines of the budget: its rule and each point the search measured."""
    if not budget:
        return []
    lines = [f"Budget: {budget['rule']}: {budget['streamed']} of {budget['total']} KV heads stream."]
    press = budget.get("kvpress")
    if press:  # what to pass kvpress for it to stream exactly these heads
        lines.append(f"kvpress: DuoAttentionPress(head_compression_ratio={press['head_compression_ratio']!r}) "
                     f"streams exactly them; it removes {press['removed']:.4f} of a {press['length']}-token KV cache "
                     f"(sink {press['sink_size']} + recent {press['recent_size']} kept per streamed head).")
    for point in budget["points"]:
        mark = "kept" if point["accepted"] else "refused"
        lines.append(f"  k = {point['k']}: loss change {point['loss_change']:+.4f}, needle accuracy "
                     f"{point['needle_accuracy']:.2f} ({mark})")
    return lines


def options_text(options: dict[str, Any]) -> str:
    """The run's options as a reader writes them (`lengths 1024, 2048; depths 0.1, 0.5`), not as raw JSON."""
    def value(item: Any) -> str:
        return ", ".join(value(part) for part in item) if isinstance(item, (list, tuple)) else (
            "none" if item is None else f"{item:g}" if isinstance(item, float) else str(item))
    return "; ".join(f"{name.replace('_', ' ')} {value(item)}" for name, item in options.items()) or "defaults"


def kv_heads_page(payload: dict[str, Any], *, embed_plotly: bool = True) -> str:
    """The layer x KV-head map beside the KV heads kept full, and the curve against random orders."""
    n_layers, n_kv = payload["n_layers"], payload["n_kv_heads"]
    kv = payload["kv_heads"]
    z = head_grid(n_layers, n_kv, ((row["layer"], row["kv_head"], int(row["label"] == "full")) for row in kv), 0)
    hover = head_grid(n_layers, n_kv, ((row["layer"], row["kv_head"], plotly_text(
        f"{long_label(row['layer'], row['kv_head']).replace('head', 'KV head')}: {row['label']}, retrieval "
        f"{row['retrieval']:.3f}, streaming {row['streaming']:.3f}, rank {row['rank']}")) for row in kv), "")
    measured = payload.get("curve")
    data = {"n_layers": n_layers, "n_kv_heads": n_kv, "z": z, "hover": hover,  # the map and the curve drawn
            "curve": None if not measured else {"k": measured["k"], "orders": measured["orders"]}}
    total = n_layers * n_kv
    accuracy = ", ".join(f"{row['length']} tokens at depth {row['depth']:g}: {row['accuracy']:.2f}"
                         for row in payload["needle_accuracy"])
    rows = [("model", str(payload["model"])), ("cache", f"sink {payload['sink']} + recent {payload['recent']} keys"),
            ("streaming", f"{payload['n_streaming']} of {total} KV heads"), ("needle accuracy", accuracy),
            *(("budget" if index == 0 else "", line.strip()) for index, line in
              enumerate(budget_lines(payload.get("budget")))),
            ("options", options_text(payload.get("options", {})))]
    curve = ('<div class="probe-section"><h2>Streaming the first k KV heads</h2><p class="probe-small">probe\'s '
             "order (retrieval ascending) against random orders: loss change on natural text, and needle accuracy "
             'on prompts other than the scored ones.</p><div class="probe-row">'
             '<div class="probe-curve-loss probe-grow"></div>'
             '<div class="probe-curve-needle probe-grow"></div></div></div>') if payload.get("curve") else ""
    full = _full(payload)
    more = f" ({LISTED} of {len(full)}; the JSON has all)" if len(full) > LISTED else ""
    body = (f"<h1>KV heads of {esc(payload['model'])}</h1>" + facts_table(rows)
            + '<div class="probe-section"><div class="probe-row"><div class="probe-grow"><h2>Layer x KV head</h2>'
            '<p class="probe-small">Red: full cache (retrieval); blue: streaming (sink + recent). Hover for the '
            'scores.</p><div class="probe-kv-map"></div></div>'
            f'<div class="probe-grow"><h2>The KV heads kept full{esc(more)}</h2>'
            + (ranked_table(FULL, _full_cells(full)) if full else
               '<p class="probe-small">None: every KV head streams.</p>') + "</div></div></div>"
            + curve)
    return page("kv_heads", f"probe kv-heads: {payload['model']}", body, data, embed_plotly=embed_plotly)

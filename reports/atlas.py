"""`probe atlas`: the terminal summary and the page (`assets/atlas.js`) from `Atlas.to_dict()`; each head's dashboard
travels deflated, decoded only when it opens."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.text import Text

from probe.errors import ProbeError
from probe.reports.html import (asset, asset_script, deflate, esc, facts_table, grid_axes, page, pattern_spec,
                                static_summary)
from probe.reports.labels import precision_clause, short_label
from probe.reports.terminal import table

if TYPE_CHECKING:
    from probe.schemas.pages import PatternsPage

STATUS_WORDS = {"confirmed": "confirmed", "partial": "partly supported", "pattern_only": "pattern only",
                "unchecked": "unchecked", "none": "no class"}
TABLE_METRICS = ("delta", "specificity", "second_repeat_delta", "task_delta", "copying", "dla", "output_norm")


def _deflated_json(data: Any) -> str:
    """JSON, deflated and base64-encoded: a head's dashboard, decoded by the page when it opens."""
    return deflate(json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8"), 9)


def _rows(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """The finder's table: every head's label, classes with their status, and its numbers."""
    names = payload.get("layer_names")
    return [{"layer": entry["layer"], "head": entry["head"], "label": short_label(entry["layer"], entry["head"], names),
             "classes": [[label["class"], label["evidence"]["status"]] for label in entry["classes"]],
             "status": entry["status"], "metrics": entry["metrics"]} for entry in payload["heads"]]


def _check(payload: dict[str, Any]) -> None:
    missing = [key for key in ("model", "n_layers", "n_heads", "heads", "classes", "metrics") if key not in payload]
    if missing:
        raise ProbeError(f"atlas result has no {missing[0]!r}")
    if not payload["heads"]:
        raise ProbeError("atlas result has no heads to show")


def _summary_rows(payload: dict[str, Any]) -> list[list[str]]:
    by_class = payload["summary"]["by_class"]
    return [[name, ", ".join(f"{count} {STATUS_WORDS[status]}" for status, count in sorted(counts.items()))]
            for name, counts in by_class.items()]


def _facts(payload: dict[str, Any]) -> str:
    settings = payload["settings"]
    stages = ", ".join(f"{s['name']} {s['seconds']:.0f} s" + (f" ({s['note']})" if s["note"] else "")
                       for s in payload["stages"])
    rows = [("model", payload["model"]), ("heads", f"{payload['n_layers']} layers x {payload['n_heads']} heads"),
            ("natural text", str(settings.get("natural", {}).get("description", settings.get("data", "")))),
            ("ablation", ("estimated (attribution patching), not ablated" if settings.get("fast") else
                          "exact zero ablation of every head") + f"; baseline loss {settings['baseline_loss']:.4f}"),
            ("stages", stages)]
    if settings.get("task"):
        rows.append(("task", str(settings["task"])))
    return facts_table(rows)


def _rules(payload: dict[str, Any]) -> str:
    evidence = payload["evidence"]
    items = "".join(f"<li><b>{esc(name)}</b>: {esc(rule['summary'])}</li>" for name, rule in evidence["rules"].items())
    return ('<details class="probe-small"><summary>How labels are checked</summary><p>A label comes from the '
            "pattern (the class score above its threshold). Each class's rule asks two more kinds of evidence: the "
            f"weights and the cause. A head is needed when its ablation raises the mean loss on natural text by more "
            f"than {evidence['cause_delta']:g} nats (or the loss on the part where its class's job pays off by more "
            f"than {evidence['part_delta']:g}); composition counts above {evidence['composition_ratio']:g} times the "
            "random baseline. Classes without a rule below are checked on the cause alone.</p>"
            f"<ul>{items}</ul><p>Badges: <span class=\"atlas-badge atlas-confirmed\">confirmed</span> every kind "
            "supports it, <span class=\"atlas-badge atlas-partial\">partly supported</span>, <span class=\"atlas-badge "
            "atlas-pattern_only\">pattern only</span>.</p></details>")


BODY = (
    '<div class="probe-section"><h2>Head finder</h2><div class="probe-controls">'
    '<label>x <select class="atlas-x" aria-label="x axis"></select></label>'
    '<label>y <select class="atlas-y" aria-label="y axis"></select></label>'
    '<label>class <select class="atlas-class" aria-label="class filter"></select></label>'
    '<label>evidence <select class="atlas-evidence" aria-label="evidence filter"></select></label>'
    '<label>search <input class="atlas-search" type="search" aria-label="search" placeholder="18.6, induction">'
    '</label><span class="probe-small atlas-count"></span></div>'
    '<p class="probe-small">One point per head, coloured by its best-supported class; filled markers: labels '
    "that the weights or the cause support too, open markers: pattern only. Click a point, a cell or a row to open "
    "the head's dashboard.</p><div class=\"atlas-legend probe-small\" aria-label=\"class colours\"></div>"
    '<div class="probe-row"><div class="atlas-scatter"></div><div class="probe-overview"><h3>Layer x head</h3>'
    '<div class="atlas-grid"></div></div></div>'
    '<div class="atlas-table-box"><table class="atlas-table"><thead></thead><tbody></tbody></table></div></div>'
    '<div class="atlas-dashboard" hidden></div>'
)


def atlas_page(payload: dict[str, Any], patterns: dict[str, PatternsPage] | None = None, *,
               embed_plotly: bool = True) -> str:
    """`probe atlas --html`: the head finder (scatter, grid, table, filters) and each head's dashboard on click."""
    _check(payload)
    names = payload.get("layer_names")
    classes = list(payload["classes"])
    data = {**grid_axes(payload["n_layers"], payload["n_heads"]), "layer_names": names,
            "metrics": payload["metrics"], "classes": classes, "class_info": payload["classes"],
            "statuses": STATUS_WORDS, "table_metrics": [m for m in TABLE_METRICS if m in payload["metrics"]],
            "rows": _rows(payload), "dashboards": [_deflated_json(entry) for entry in payload["heads"]],
            "patterns": {name: pattern_spec(block, 1) for name, block in (patterns or {}).items()},
            "fast": bool(payload["settings"].get("fast"))}
    static = static_summary("Labels and their evidence", ["class", "labels"], _summary_rows(payload))
    note = ('<p class="probe-note">Ablation deltas on this page are <b>estimated</b> (attribution patching, '
            "--fast), not measured: run without --fast for numbers to report.</p>" if data["fast"] else "")
    body = (f"<style>{asset('atlas.css')}</style><h1>Atlas of {esc(payload['model'])}</h1>" + _facts(payload)
            + note + _rules(payload) + static + BODY + asset_script("atlas.js"))
    return page("atlas", f"probe atlas: {payload['model']}", body, data, embed_plotly=embed_plotly)


def atlas_report(payload: dict[str, Any], console: Console, *, top: int = 15) -> None:
    """Labels by evidence, per class; the pattern-only labels; the heads the model needs without a label."""
    summary = payload["summary"]
    console.print(Text(f"Atlas of {payload['model']}: {summary['labels']} labels on "
                       f"{payload['n_layers'] * payload['n_heads']} heads", style="bold"))
    console.print(table("class", "labels", left=("class", "labels"), rows=_summary_rows(payload)))
    for title, heads in (("pattern only", summary["pattern_only"]),
                         (f"needed without a label ({summary['needed']} heads needed in all)",
                          summary["needed_without_label"])):
        shown = ", ".join(heads[:top]) + (f" and {len(heads) - top} more" if len(heads) > top else "")
        console.print(f"  {title}: {shown or 'none'}", markup=False, highlight=False)
    stages = ", ".join(f"{s['name']} {s['seconds']:.1f} s" + (f" ({s['note']})" if s["note"] else "")
                       for s in payload["stages"])
    console.print(Text(f"  {stages}{precision_clause(payload)}", style="dim"))


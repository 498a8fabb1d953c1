"""`probe prune --html`: pruning curves from `PruneResult.to_dict()`, the random orderings as a band."""

from __future__ import annotations

from typing import Any

from probe.errors import ProbeError
from probe.reports.html import esc, facts_table, page
from probe.reports.labels import precision_fact

COLORS = {"michel": "#b2182b", "sweep": "#2166ac"}
NAMES = {"michel": "Michel importance (recomputed each step)", "sweep": "single-head sweep order"}


def _band(curves: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Lowest and highest loss of the random curves at each step that any of them reached."""
    random = [curve["steps"] for curve in curves if curve["ordering"] == "random"]
    if not random:
        return None
    longest = max(random, key=len)
    share, low, high = [], [], []
    for index, step in enumerate(longest):
        values = [steps[index]["loss"] for steps in random if index < len(steps) and steps[index]["loss"] is not None]
        share.append(step["share_pruned"])
        low.append(min(values))
        high.append(max(values))
    return {"share": share, "low": low, "high": high, "name": f"random order ({len(random)} seeds: lowest to highest)"}


def prune_verdict(payload: dict[str, Any], limit: str) -> str | None:
    """In words, the most any ordering pruned within `limit` (--max-increase as given); None without a limit."""
    if payload.get("max_loss") is None:
        return None
    most, most_loss, ordering = 0.0, payload["baseline_loss"], ""
    units = "key/value groups" if payload.get("units") == "kv_groups" else "heads"
    for curve in payload["curves"]:
        for step in curve["steps"]:
            if step["loss"] is not None and step["loss"] <= payload["max_loss"] and step["share_pruned"] > most:
                most, most_loss, ordering = step["share_pruned"], step["loss"], curve["ordering"]
    within = f"within +{limit.strip().lstrip('+')} (loss at most {payload['max_loss']:.4f})"
    if not ordering:
        return f"No fraction of {units} can be pruned {within}: every ordering's first step passes it."
    return f"Up to {most:.0%} of the {units} can be pruned {within}: the {ordering} ordering, loss {most_loss:.4f}."


def prune_data(payload: dict[str, Any]) -> dict[str, Any]:
    curves = payload.get("curves")
    if not isinstance(curves, list) or not curves:
        raise ProbeError("pruning result has no curves to draw")
    lines = [{"name": NAMES.get(curve["ordering"], curve["ordering"]), "color": COLORS.get(curve["ordering"], "#333"),
              "dash": "solid", "share": [step["share_pruned"] for step in curve["steps"]],
              "loss": [step["loss"] for step in curve["steps"]]} for curve in curves if curve["ordering"] != "random"]
    limits = [{"value": payload["baseline_loss"], "color": "#444"}]
    if payload.get("max_loss") is not None:
        limits.append({"value": payload["max_loss"], "color": "#b2182b"})
    units = "key/value groups" if payload.get("units") == "kv_groups" else "heads"
    return {"lines": lines, "band": _band(curves), "limits": limits, "units": units, "metric": payload["metric"],
            "log": False}


def prune_page(payload: dict[str, Any], *, embed_plotly: bool = True) -> str:
    data = prune_data(payload)
    rows = [("model", str(payload["model"])), ("metric", str(payload["metric"])),
            ("method", f"{payload['method']} ablation, all pruned heads together"),
            ("data", str(payload["data"]) if payload.get("measured_on") in (None, payload["data"])
             else f"orders chosen on {payload['data']}, losses measured on {payload['measured_on']}"),
            ("baseline", f"{payload['baseline_loss']:.4f}"),
            ("units", f"{payload['n_units']} {data['units']}, {payload['step']:.0%} per step"),
            ("limit", "none (to 100%)" if payload.get("max_loss") is None else f"{payload['max_loss']:.4f}")]
    if payload.get("note"):
        rows.append(("note", str(payload["note"])))
    rows += precision_fact(payload)
    body = (f"<h1>Pruning curves of {esc(payload['model'])}</h1>" + facts_table(rows)
            + '<p class="probe-small">Dotted: the baseline (grey) and the largest loss allowed (red).</p>'
            '<div class="probe-prune-plot"></div>')
    return page("prune", f"probe prune: {payload['model']}", body, data, embed_plotly=embed_plotly)

"""`probe track`'s terminal summary and page, from `TrackResult.to_dict()`."""

from __future__ import annotations

from typing import Any

from rich.box import HEAVY_HEAD
from rich.console import Console
from rich.table import Table

from probe.reports.html import asset_script, esc, facts_table, head_grid, page, plain_table
from probe.reports.terminal import print_precision, table
from probe.reports.labels import long_label, number, short_label


def _best(checkpoint: dict[str, Any], name: str) -> str:
    scored = [(e["scores"].get(name), e) for e in checkpoint["heads"] if e["scores"].get(name) is not None]
    if not scored:
        return "n/a"
    value, entry = max(scored, key=lambda item: item[0])
    return f"{value:.2f} (head {short_label(entry['layer'], entry['head'])})"  # `0.03 (0.3)` reads as two numbers


RULED: dict[str, Any] = {"show_edge": True, "pad_edge": True, "box": HEAVY_HEAD, "title_justify": "left"}  # rich's look


def _trajectory_table(payload: dict[str, Any]) -> Table:
    classes = list(payload["thresholds"])
    return table("checkpoint", "step", "loss", "ICL score", *classes, left=("checkpoint",), **RULED,
                 title="Per checkpoint: loss, in-context learning score, best head of each class", rows=(
                     [checkpoint["name"], str(checkpoint["step"]), number(checkpoint["loss"]),
                      number(checkpoint["icl_score"]), *(_best(checkpoint, name) for name in classes)]
                     for checkpoint in payload["checkpoints"]))


def _phase_table(payload: dict[str, Any]) -> Table:
    columns = ("class", "steps", "best head score", "heads crossing the threshold", "ICL change there",
               "ICL's largest change")
    return table(*columns, left=columns, **RULED, title=f"Phase changes (the best head's largest rise between two "
                 f"checkpoints, at least {payload['min_rise']:g})", rows=(
                     [change["class"], f"{change['from_step']} -> {change['to_step']}",
                      f"{change['best_before']:.2f} -> {change['best_after']:.2f}",
                      ", ".join(change["heads"]) or "none", number(change["icl_change"]),
                      "yes, same interval" if change["coincides_with_icl"] else "no"]
                     for change in payload["phase_changes"]))


def track_report(payload: dict[str, Any], console: Console) -> None:
    """The terminal summary of a run."""
    checkpoints = payload["checkpoints"]
    steps = f"steps {checkpoints[0]['step']} to {checkpoints[-1]['step']}" if checkpoints else "no checkpoints"
    console.print(f"[bold]{payload['model']}[/bold]: {len(checkpoints)} checkpoints ({steps}), "
                  f"{payload['n_layers']} layers x {payload['n_heads']} heads")
    console.print(_trajectory_table(payload))
    if payload["phase_changes"]:
        console.print(_phase_table(payload))
    else:
        console.print(f"No phase change: no class's best head rises by {payload['min_rise']:g} or more between two "
                      "checkpoints.")
    icl = payload.get("icl_change")
    if icl:
        console.print(f"In-context learning score: its largest change is {icl['change']:+.3f} between steps "
                      f"{icl['from_step']} and {icl['to_step']} (loss on token {payload['options']['late']} minus "
                      f"token {payload['options']['early']}; lower is more in-context learning).")
    print_precision(payload, console)


def _flagged(payload: dict[str, Any], name: str) -> set[tuple[int, int]]:
    """Heads the page highlights: crossing the threshold at the phase change, or over it at the last checkpoint."""
    heads = {(int(layer), int(head)) for change in payload["phase_changes"] if change["class"] == name
             for layer, head in (label.split(".") for label in change["heads"])}
    last = payload["checkpoints"][-1]["heads"] if payload["checkpoints"] else []
    threshold = payload["thresholds"][name]
    return heads | {(e["layer"], e["head"]) for e in last if (e["scores"].get(name) or 0) > threshold}


def track_data(payload: dict[str, Any]) -> dict[str, Any]:
    """The page's data: per class one line per head over the steps, and the layer x head grid at every step."""
    checkpoints = payload["checkpoints"]
    n_layers, n_heads = payload["n_layers"], payload["n_heads"]
    classes = {}
    for name, threshold in payload["thresholds"].items():
        flagged = _flagged(payload, name)
        values: dict[tuple[int, int], list[Any]] = ({(e["layer"], e["head"]): [] for e in checkpoints[0]["heads"]}
                                                   if checkpoints else {})
        grids = []
        for checkpoint in checkpoints:
            cells = [(entry["layer"], entry["head"], entry["scores"].get(name)) for entry in checkpoint["heads"]]
            for layer, head, value in cells:
                values[(layer, head)].append(value)
            grids.append(head_grid(n_layers, n_heads, cells))
        lines = [{"label": short_label(*key), "name": long_label(*key), "y": ys, "flagged": key in flagged}
                 for key, ys in values.items()]
        change = next((c for c in payload["phase_changes"] if c["class"] == name), None)
        classes[name] = {"threshold": threshold, "lines": lines, "grids": grids,
                         "change": None if change is None else [change["from_step"], change["to_step"]]}
    return {"steps": [c["step"] for c in checkpoints], "names": [c["name"] for c in checkpoints],
            "loss": [c["loss"] for c in checkpoints], "icl": [c["icl_score"] for c in checkpoints],
            "icl_change": payload.get("icl_change"), "classes": classes, "n_layers": n_layers, "n_heads": n_heads}


def _phase_rows(payload: dict[str, Any]) -> str:
    rows = [[c["class"], f"{c['from_step']} → {c['to_step']}", f"{c['best_before']:.3f} → {c['best_after']:.3f}",
             ", ".join(c["heads"]) or "none", number(c["icl_change"]), "yes" if c["coincides_with_icl"] else "no"]
            for c in payload["phase_changes"]]
    if not rows:
        return f'<p class="probe-phase-none">No phase change (no rise of {payload["min_rise"]:g} or more).</p>'
    return plain_table(["class", "steps", "best head", "heads crossing", "ICL change there", "ICL's largest change"],
                       rows, "probe-phases")


def track_page(payload: dict[str, Any]) -> str:
    """`probe track --html`: self-contained, every text escaped."""
    checkpoints, options = payload["checkpoints"], payload["options"]
    rows = [("model", str(payload["model"])), ("checkpoints", f"{len(checkpoints)} ({payload['kind']}), steps "
             + (f"{checkpoints[0]['step']} to {checkpoints[-1]['step']}" if checkpoints else "none")),
            ("heads", f"{payload['n_layers']} layers x {payload['n_heads']} heads"),
            ("in-context learning", f"loss on token {options['late']} minus token {options['early']} "
                                    f"(Olsson et al. 2022), {options['icl_seqs']} texts")]
    body = (f"<h1>Heads across training: {esc(payload['model'])}</h1>" + facts_table(rows)
            + "<h2>Phase changes</h2>" + _phase_rows(payload)
            + '<h2>In-context learning score and loss</h2><div class="probe-track-icl"></div>'
            + "<h2>Scores against the training step</h2>"
            + '<p class="probe-small">One line per head; coloured: the heads crossing the threshold at the phase '
              "change or over it at the last checkpoint. The shaded band marks the phase change.</p>"
            + "".join(f'<h3>{esc(name)}</h3><div class="probe-track-class" data-class="{esc(name)}"></div>'
                      for name in payload["thresholds"])
            + '<h2>Layer x head at one step</h2><div class="probe-controls"><label>Class <select '
              'class="probe-track-select" aria-label="class">'
            + "".join(f'<option value="{esc(name)}">{esc(name)}</option>' for name in payload["thresholds"])
            + '</select></label><label>Step <input type="range" class="probe-track-slider" min="0" max="'
            + f'{max(0, len(checkpoints) - 1)}" value="{max(0, len(checkpoints) - 1)}" aria-label="step"></label>'
            + '<span class="probe-track-step"></span></div><div class="probe-track-grid"></div>'
            + asset_script("track.js"))
    return page("track", f"probe track: {payload['model']}", body, track_data(payload), embed_plotly=True)

"""bench/kvpress.py's rows summed into cells (Wilson intervals, loss changes), its RESULTS.md section, the table on
docs/kv-heads.md and the plot docs/images/kvpress-head-to-head.svg (written by hand: no plotting dependency).
Imports nothing of kvpress, so `python -m bench --render` renders it anywhere."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from bench.common import ROOT

DOCS = ROOT / "docs" / "kv-heads.md"
PLOT = ROOT / "docs" / "images" / "kvpress-head-to-head.svg"
BEGIN, END = "<!-- bench.kvpress: begin -->", "<!-- bench.kvpress: end -->"
Z = 1.959964  # the normal quantile of a two-sided 95% interval
ORDER = ("probe map", "random map", "StreamingLLM", "SnapKV", "ExpectedAttention", "Knorm")


def wilson(correct: int, n: int) -> tuple[float, float]:
    """The Wilson score interval (95%) of a proportion `correct` / `n` (Wilson 1927)."""
    if n == 0:
        return 0.0, 1.0
    p = correct / n
    centre = (p + Z * Z / (2 * n)) / (1 + Z * Z / n)
    half = Z * math.sqrt(p * (1 - p) / n + Z * Z / (4 * n * n)) / (1 + Z * Z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _method(key: str) -> tuple[str, float]:
    if key == "none":
        return "none", 0.0
    method, fraction = key.rsplit("@", 1)
    return method, float(fraction)


def aggregate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One cell per (length, method, fraction): needle accuracy over its prompts with a Wilson interval, the mean
    compression ratio kvpress reported and the fraction of cache entries counted removed, and the loss change
    (the continuations' pooled mean cross-entropy with the press minus without)."""
    cells: dict[tuple[int, str], dict[str, Any]] = {}
    for row in rows:
        for key, found in row["results"].items():
            if not isinstance(found, dict):
                continue
            cell = cells.setdefault((row["length"], key), {"right": 0, "n": 0, "reported": [], "removed": [],
                                                           "loss": 0.0, "tokens": 0, "base": 0.0, "texts": 0,
                                                           "depths": {}})
            cell["removed"].append(found["removed"])
            if "reported" in found:
                cell["reported"].append(found["reported"])
            if row["kind"] == "needle":
                right = found["answer"].strip().startswith(row["key"])
                cell["n"] += 1
                cell["right"] += right
                tally = cell["depths"].setdefault(str(row["depth"]), [0, 0])
                tally[0], tally[1] = tally[0] + right, tally[1] + 1
            else:
                cell["texts"] += 1
                cell["loss"] += found["loss_sum"]
                cell["tokens"] += found["tokens"]
                cell["base"] += row["results"]["none"]["loss_sum"]
    out = []
    for (length, key), cell in sorted(cells.items()):
        method, fraction = _method(key)
        low, high = wilson(cell["right"], cell["n"])
        tokens = max(cell["tokens"], 1)
        out.append({"length": length, "method": method, "fraction": fraction, "needle_n": cell["n"],
                    "needle_right": cell["right"], "accuracy": cell["right"] / max(cell["n"], 1),
                    "ci": [round(low, 4), round(high, 4)],
                    "reported": round(statistics.mean(cell["reported"]), 4) if cell["reported"] else 0.0,
                    "removed": round(statistics.mean(cell["removed"]), 4), "texts": cell["texts"],
                    "by_depth": dict(sorted(cell["depths"].items())),
                    "loss": round(cell["loss"] / tokens, 5) if cell["texts"] else None,
                    "loss_change": round((cell["loss"] - cell["base"]) / tokens, 5) if cell["texts"] else None})
    return out


def timing(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind and length: units, median prefill seconds, median seconds per press (apply + answer or loss), and
    median wall seconds per unit."""
    out: dict[str, Any] = {}
    for row in rows:
        entry = out.setdefault(f"{row['kind']} {row['length']}", {"units": 0, "prefill": [], "press": [], "unit": []})
        entry["units"] += 1
        entry["prefill"].append(row["results"]["prefill_seconds"])
        entry["unit"].append(row["seconds"])
        entry["press"] += [found["seconds"] for found in row["results"].values() if isinstance(found, dict)]
    return {name: {"units": entry["units"], "presses_per_unit": len(entry["press"]) // max(entry["units"], 1),
                   "median_prefill_s": round(statistics.median(entry["prefill"]), 2),
                   "median_press_s": round(statistics.median(entry["press"]), 2),
                   "median_unit_s": round(statistics.median(entry["unit"]), 1)} for name, entry in out.items()}


def map_summary(folder: Path) -> dict[str, Any]:
    """probe's map as the bench used it: sizes, KV heads, the budget's own streamed count."""
    config = json.loads((folder / "config.json").read_text())
    budget_path = folder / "probe_budget.json"
    budget = json.loads(budget_path.read_text()) if budget_path.is_file() else {}
    rows = [line.split("\t") for line in (folder / "full_attention_heads.tsv").read_text().split("\n") if line]
    return {"folder": str(folder.relative_to(ROOT)), "sink_size": config["sink_size"],
            "recent_size": config["recent_size"], "layers": len(rows), "kv_heads": len(rows[0]),
            "budget_streamed": budget.get("streamed_count", budget.get("streamed")),
            "command": "probe kv-heads --full-fraction 0.5 --no-curve --export duo:" + str(folder.relative_to(ROOT))}


COLOURS = {"probe map": "#d62728", "random map": "#7f7f7f", "StreamingLLM": "#1f77b4", "SnapKV": "#2ca02c",
           "ExpectedAttention": "#9467bd", "Knorm": "#ff7f0e"}


def _cells(data: dict[str, Any], length: int) -> dict[tuple[str, float], dict[str, Any]]:
    return {(cell["method"], cell["fraction"]): cell for cell in data["cells"] if cell["length"] == length}


def _accuracy(cell: dict[str, Any] | None) -> str:
    if cell is None or not cell["needle_n"]:
        return "-"
    return f"{cell['accuracy']:.2f} [{cell['ci'][0]:.2f}, {cell['ci'][1]:.2f}]"


def _loss(cell: dict[str, Any] | None) -> str:
    return "-" if cell is None or cell["loss_change"] is None else f"{cell['loss_change']:+.3f}"


def table(data: dict[str, Any], length: int) -> list[str]:
    """One length: per fraction removed and method, the needle accuracy [95% Wilson interval] over n prompts, the
    compression ratio kvpress reported and the loss change; no compression first."""
    cells = _cells(data, length)
    texts = sorted({cell["texts"] for cell in cells.values()})
    lines = [f"**{length} tokens of context** (SmolLM2-135M-Instruct, CPU, float32; loss change over "
             f"{'/'.join(map(str, texts))} natural text(s) per cell):", "",
             "| removed | method | needle accuracy [95% CI] | right / n | kvpress ratio | loss change |",
             "|---:|---|---:|---:|---:|---:|"]
    base = cells.get(("none", 0.0))
    if base is not None:
        lines.append(f"| 0 | no compression | {_accuracy(base)} | {base['needle_right']} / {base['needle_n']} | - | "
                     f"0 (loss {base['loss'] if base['loss'] is not None else '-'}) |")
    for fraction in data["fractions"]:
        for method in ORDER:
            cell = cells.get((method, fraction))
            if cell is None:
                continue
            name = f"**{method}**" if method == "probe map" else method
            lines.append(f"| {fraction:.0%} | {name} | {_accuracy(cell)} | {cell['needle_right']} / "
                         f"{cell['needle_n']} | {cell['reported']:.3f} | {_loss(cell)} |")
    return lines


def depth_table(data: dict[str, Any], length: int) -> list[str]:
    """Right / n by the needle's depth in the context, per fraction and method."""
    cells = _cells(data, length)
    depths = [str(depth) for depth in data["depths"]]
    lines = [f"By the needle's depth ({length} tokens; right / n):", "",
             "| removed | method | " + " | ".join(depths) + " |", "|---:|---|" + "---:|" * len(depths)]
    keys = [("none", 0.0)] + [(method, fraction) for fraction in data["fractions"] for method in ORDER]
    for method, fraction in keys:
        cell = cells.get((method, fraction))
        if cell is None or not cell["needle_n"]:
            continue
        found = cell.get("by_depth", {})
        lines.append(f"| {fraction:.0%} | {method} | "
                     + " | ".join("-" if d not in found else f"{found[d][0]} / {found[d][1]}" for d in depths) + " |")
    return lines


def verdict(data: dict[str, Any], length: int = 2048, fraction: float = 0.7) -> str:
    """The target: at 70% removed and 2048 tokens, probe's map keeps needle accuracy >= 0.9 and is at least as good
    as every kvpress press (point estimates; the intervals are in the table)."""
    cells = _cells(data, length)
    mine = cells.get(("probe map", fraction))
    if mine is None or not mine["needle_n"]:
        return f"Target at {fraction:.0%} removed, {length} tokens: not measured yet."
    others = {method: cells[(method, fraction)]["accuracy"] for method in ORDER[2:] if (method, fraction) in cells}
    beaten = [f"{method} {value:.2f}" for method, value in others.items() if value > mine["accuracy"]]
    level = mine["accuracy"] >= 0.9
    return (f"Target at {fraction:.0%} removed, {length} tokens (n = {mine['needle_n']}): probe's map needle accuracy "
            f"{mine['accuracy']:.2f} ({'>= 0.9: **met**' if level else '< 0.9: **not met**'}); "
            + ("at least as good as every kvpress press: **met**." if not beaten else
               f"kvpress presses above it: {', '.join(beaten)} (**not met**)."))


def section(data: dict[str, Any]) -> str:
    """bench/RESULTS.md's section."""
    runs = data.get("runs", {})
    run = next(iter(runs.values()), {})
    found = data["map"]
    found_machine = run.get("machine", {})
    versions = found_machine.get("versions", {})
    lines = ["## kvpress: probe's KV-head map against kvpress's presses, SmolLM2, CPU, float32", "",
             f"- {found_machine.get('cpu', '?')}; torch {versions.get('torch')}, transformers "
             f"{versions.get('transformers')}, kvpress {versions.get('kvpress')}; `{run.get('command')}`, "
             f"{run.get('threads')} thread(s) per process (several processes shared the grid: bench/NOTES.md); rows "
             f"from {data.get('rows_from')} to {data.get('rows_to')}, 1-minute load average "
             f"{'-'.join(f'{x:.0f}' for x in data.get('load_range') or [] if x is not None)} on "
             f"{found_machine.get('cores')} cores",
             f"- probe's map: `{found['command']}` ({found['layers']} layers x {found['kv_heads']} KV heads, sink "
             f"{found['sink_size']} + recent {found['recent_size']}); needle prompts of seed {data['seed']}, depths "
             f"{data['depths']}; greedy answers of {data['answer_tokens']} tokens; loss of {data['continuation']} "
             "continuation tokens after the context. How: bench/NOTES.md.", ""]
    lines += tables(data)
    lines.append(verdict(data))
    return "\n".join(lines) + "\n"


def tables(data: dict[str, Any]) -> list[str]:
    """Each length's table and its table by depth (RESULTS.md's section, and docs/kv-heads.md between the
    markers)."""
    return [line for length in data["lengths"]
            for line in table(data, length) + [""] + depth_table(data, length) + [""]]


def _svg_panel(data: dict[str, Any], length: int, left: float, width: float, top: float, height: float) -> list[str]:
    cells = _cells(data, length)
    fractions = data["fractions"]
    span = max(fractions) - min(fractions) or 1.0
    low_x, high_x = min(fractions) - 0.08 * span, max(fractions) + 0.08 * span

    def x(value: float) -> float:
        return left + (value - low_x) / (high_x - low_x) * width

    def y(value: float) -> float:
        return top + (1 - value) * height

    out = [f'<rect x="{left}" y="{top}" width="{width}" height="{height}" fill="none" stroke="#999"/>',
           f'<text x="{left + width / 2}" y="{top - 8}" text-anchor="middle" font-size="13">{length} tokens, '
           f'{max((cell["needle_n"] for cell in cells.values()), default=0)} needle prompts per point</text>']
    for tick in (0, 0.25, 0.5, 0.75, 1.0):
        out.append(f'<line x1="{left}" x2="{left + width}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" stroke="#eee"/>')
        out.append(f'<text x="{left - 5}" y="{y(tick) + 4:.1f}" text-anchor="end" font-size="11">{tick:g}</text>')
    for fraction in fractions:
        out.append(f'<text x="{x(fraction):.1f}" y="{top + height + 15}" text-anchor="middle" font-size="11">'
                   f'{fraction:.0%}</text>')
    if not any(cell["needle_n"] for cell in cells.values()):
        out.append(f'<text x="{left + width / 2}" y="{top + height / 2}" text-anchor="middle" font-size="12" '
                   'fill="#666">no needle prompts measured</text>')
    base = cells.get(("none", 0.0))
    if base and base["needle_n"]:
        out.append(f'<line x1="{left}" x2="{left + width}" y1="{y(base["accuracy"]):.1f}" '
                   f'y2="{y(base["accuracy"]):.1f}" stroke="#000" stroke-dasharray="4 3"/>')
    for index, method in enumerate(ORDER):
        shift = (index - (len(ORDER) - 1) / 2) * 6  # pixels: the methods' bars side by side
        points = [(x(f) + shift, cells[(method, f)]) for f in fractions
                  if (method, f) in cells and cells[(method, f)]["needle_n"]]
        colour = COLOURS[method]
        if len(points) > 1:
            path = " ".join(f"{px:.1f},{y(c['accuracy']):.1f}" for px, c in points)
            out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
        for px, cell in points:
            out.append(f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{y(cell["ci"][0]):.1f}" y2="{y(cell["ci"][1]):.1f}" '
                       f'stroke="{colour}"/>')
            out.append(f'<circle cx="{px:.1f}" cy="{y(cell["accuracy"]):.1f}" r="3" fill="{colour}"/>')
    return out


def svg(data: dict[str, Any]) -> str:
    """Needle accuracy against the fraction of the KV cache removed, one panel per length, 95% Wilson intervals as
    bars, no compression dashed."""
    width, height, panel_w, panel_h = 930, 330, 330, 220
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif">',
             f'<rect width="{width}" height="{height}" fill="#fff"/>',
             '<text x="20" y="20" font-size="13">Needle accuracy, SmolLM2-135M-Instruct, CPU, float32 (95% Wilson '
             'intervals; dashed: no compression)</text>']
    for index, length in enumerate(data["lengths"]):
        parts += _svg_panel(data, length, 50 + index * (panel_w + 40), panel_w, 50, panel_h)
    parts.append(f'<text x="{50 + panel_w + 20}" y="{50 + panel_h + 35}" text-anchor="middle" font-size="12">'
                 'fraction of the KV cache removed</text>')
    for index, method in enumerate(ORDER):
        parts += [f'<rect x="{width - 145}" y="{60 + index * 20}" width="12" height="12" fill="{COLOURS[method]}"/>',
                  f'<text x="{width - 127}" y="{71 + index * 20}" font-size="12">{method}</text>']
    parts.append("</svg>")
    return "\n".join(parts) + "\n"

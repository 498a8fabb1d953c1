"""Self-contained HTML pages from plain payloads (probe imported for its error type only): one file that works
offline from file://, plotly.js and `assets/probe.js` inlined, a Content-Security-Policy forbidding every request,
patterns deflated and decoded in the browser a head at a time. Text in HTML goes through `html.escape`, text plotly
draws is entity-escaped, JSON in <script> has <, > and & as \\u escapes; nothing reaches innerHTML."""

from __future__ import annotations

import base64
import html
import json
import math
import uuid
import zlib
from collections.abc import Collection, Iterable
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from probe.errors import ProbeError
from probe.reports.labels import LayerNames, long_label, precision_fact, short_label

if TYPE_CHECKING:
    from probe.schemas.pages import PatternsPage

ASSETS = Path(__file__).parent / "assets"
CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data: blob:; "
       "font-src data:; connect-src 'none'; form-action 'none'; base-uri 'none'")
TOP_HEADS = 20  # bars in the ablation chart
STATIC_HEADS = 10  # heads in the summary table shown without JavaScript


def plotly_js() -> str:
    """plotly.js to inline: the 1.5 MB cartesian bundle of reports/assets, else the installed plotly's 4.8 MB one."""
    bundled = ASSETS / "plotly-cartesian.min.js"
    if bundled.is_file():
        text = bundled.read_text(encoding="utf-8")
    else:
        text = resources.files("plotly").joinpath("package_data").joinpath("plotly.min.js").read_text(encoding="utf-8")
    return text.replace("</script", "<\\/script")


def asset(name: str) -> str:
    """A file of reports/assets: a page's stylesheet (`page.css`, `atlas.css`) or script."""
    return (ASSETS / name).read_text(encoding="utf-8")


def asset_script(name: str) -> str:
    """A script of reports/assets (`probe.js`, a page's own), as a <script> element to inline."""
    return "<script>" + asset(name).replace("</script", "<\\/script") + "</script>"


# Run a notebook result's inert copy of plotly.js only where the output's document has none yet: each output (in
# the notebook's page or in an iframe of its own) is drawn wherever it is shown, and plotly runs once per document.
# require.js (classic Jupyter) would take plotly's UMD bundle as an AMD module and leave window.Plotly unset, so
# `define` is hidden while it runs.
PLOTLY_LOADER = """(function () {
  if (window.Plotly) return;
  var copy = document.getElementById(%s);
  if (!copy) return;
  var amd = window.define;
  window.define = undefined;
  try {
    var script = document.createElement("script");
    script.textContent = copy.textContent;
    document.head.appendChild(script);
  } finally {
    window.define = amd;
  }
})();"""


def esc(text: Any) -> str:
    """Text for HTML: every <, >, &, " and ' escaped."""
    return html.escape(str(text), quote=True)


def plotly_text(text: str) -> str:
    """Text for plotly, which reads a little HTML (<b>, <br>, <a href>) in labels: show the characters instead."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def script_json(data: Any) -> str:
    """JSON that is safe inside <script>: no '</script>', no '<!--', no line separators JavaScript dislikes."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    for char, code in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"),
                       ("\u2029", "\\u2029")):
        text = text.replace(char, code)
    return text


def deflate(data: bytes, level: int = 6) -> str:
    """Base64 of the deflated bytes: what a page inflates in the browser when it needs it."""
    return base64.b64encode(zlib.compress(data, level)).decode("ascii")


def pack_uint16(values: np.ndarray) -> str:
    """uint16 values as base64 of deflate of their byte planes (low bytes, then high bytes): attention weights in
    thousandths are mostly below 256, so the high plane is nearly all zeros and compresses to almost nothing."""
    planes = np.ascontiguousarray(values, dtype="<u2").reshape(-1).view(np.uint8).reshape(-1, 2)
    return deflate(np.ascontiguousarray(planes.T).tobytes())


def pattern_spec(patterns: PatternsPage, group: int) -> dict[str, Any]:
    """A `Patterns.page_payload()` for the page: heads deflated `group` at a time, a causal model's lower half."""
    n, heads, values = len(patterns["tokens"]), patterns["heads"], patterns["values"]
    flat = values.reshape(len(heads), n * n)  # (heads, queries * keys)
    rows, cols = np.tril_indices(n)
    keep = rows * n + cols if patterns["causal"] else None
    chunks = []
    for first in range(0, len(heads), group):
        part = flat[first:first + group]
        chunks.append(pack_uint16(part[:, keep] if keep is not None else part))
    spec: dict[str, Any] = {
        "n": n, "labels": [plotly_text(label) for label in patterns["labels"]],
        "heads": [list(pair) for pair in heads], "causal": patterns["causal"], "scale": patterns["scale"],
        "decimals": patterns["decimals"], "group": group, "chunks": chunks, "thumbs": None,
        "first": int(patterns.get("first") or 0), "layer_names": patterns.get("layer_names"),
    }
    meta = patterns.get("meta") or {}
    if meta.get("repeat_len"):  # a repeated probe set: where the second copy starts (the page marks it)
        spec.update(repeat=int(meta["repeat_len"]), offset=int(meta.get("offset") or 0))
    thumbnails = patterns.get("thumbnails")
    if thumbnails is not None:  # (heads, t, t) uint8
        spec["thumbs"] = {"t": int(thumbnails.shape[-1]),
                          "data": deflate(np.ascontiguousarray(thumbnails, dtype=np.uint8).tobytes())}
    return spec


def page(kind: str, title: str, body: str, data: dict[str, Any], *, embed_plotly: bool) -> str:
    """A whole document (embed_plotly) or a fragment for a notebook; `body` is already escaped HTML."""
    page_id = "probe-page" if embed_plotly else f"probe-{uuid.uuid4().hex[:12]}"
    style = asset("page.css")
    start = f"<script>window.probeReports.start({json.dumps(kind)}, {json.dumps(page_id)});</script>"
    content = (f'<div class="probe-page" id="{page_id}" data-kind="{kind}" data-state="loading">{body}</div>\n'
               f'<script type="application/json" id="{page_id}-data">{script_json(data)}</script>\n')
    if not embed_plotly:  # a notebook output: a fragment that carries plotly.js, run only where it is missing
        carry = (f'<script type="text/plain" id="{page_id}-plotly">{plotly_js()}</script>\n'
                 f"<script>{PLOTLY_LOADER % json.dumps(page_id + '-plotly')}</script>\n")
        return (f"<style>{style}</style>\n{content}{carry}{asset_script('probe.js')}\n{start}\n")
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f'<meta http-equiv="Content-Security-Policy" content="{esc(CSP)}">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{esc(title)}</title>\n<style>{style}\nbody {{ margin: 0; background: #fff; }}</style>\n</head>\n"
        f"<body>\n{content}<script>{plotly_js()}</script>\n{asset_script('probe.js')}\n{start}\n"
        "</body>\n</html>\n"
    )


def plain_table(header: list[str], rows: list[list[str]], kind: str = "") -> str:
    """A table of text, every cell escaped; `kind`: a class that tests and scripts find it by."""
    head = "".join(f"<th>{esc(cell)}</th>" for cell in header)
    body = "".join("<tr>" + "".join(f"<td>{esc(cell)}</td>" for cell in row) + "</tr>" for row in rows)
    return f'<table class="probe-static-table{" " + kind if kind else ""}"><tr>{head}</tr>{body}</table>'


def static_summary(title: str, header: list[str], rows: list[list[str]]) -> str:
    """A summary table for viewers that run no JavaScript (GitHub, nbviewer, e-mail): hidden once the plots draw."""
    return (f'<div class="probe-static"><p class="probe-small">{esc(title)} (the interactive plots need '
            f"JavaScript)</p>{plain_table(header, rows)}</div>")


def head_grid(n_layers: int, n_heads: int, cells: Iterable[tuple[int, int, Any]], empty: Any = None) -> list[Any]:
    """A layer x head map's rows: each cell's (layer, head, value), `empty` where a head has none."""
    grid = [[empty] * n_heads for _ in range(n_layers)]
    for layer, head, value in cells:
        grid[layer][head] = value
    return grid


def rounded_grid(payload: dict[str, Any], rows: Iterable[dict[str, Any]], key: str) -> list[list[float | None]]:
    """The payload's layer x head map of the rows' `key`, to 6 decimals (None where a head has no value)."""
    return head_grid(payload["n_layers"], payload["n_heads"], ((row["layer"], row["head"], round(float(value), 6))
                                                               for row in rows if (value := row.get(key)) is not None))


def grid_axes(n_layers: int, n_heads: int) -> dict[str, Any]:
    """The page data's shape of a layer x head map (probe.js draws its axes from these)."""
    return {"n_layers": n_layers, "n_heads": n_heads, "layer_axis": list(range(n_layers)),
            "head_axis": list(range(n_heads))}


def facts_table(rows: list[tuple[str, str]]) -> str:
    """The page's key/value table under its title (model, input, options): every cell escaped."""
    return '<table class="probe-kv">' + "".join(
        f"<tr><td>{esc(key)}</td><td>{esc(value)}</td></tr>" for key, value in rows) + "</table>"


def ranked_table(header: list[str], rows: list[list[str]], text: Collection[int] = (), kind: str = "") -> str:
    """A terminal report's table of ranked heads on the page: the columns at `text` are words, the rest numbers;
    `kind`: a class that tests and scripts find it by. Hyphens in the header do not break (U+2011)."""
    cells = ["".join(f'<td class="probe-text">{esc(cell)}</td>' if i in text else f"<td>{esc(cell)}</td>"
                     for i, cell in enumerate(row)) for row in rows]
    head = "".join(('<th class="probe-text">' if i in text else "<th>") + esc(cell).replace("-", chr(0x2011)) + "</th>"
                   for i, cell in enumerate(header))
    return (f'<table class="probe-ranked{" " + kind if kind else ""}"><tr>{head}</tr>'
            + "".join(f"<tr>{row}</tr>" for row in cells) + "</table>")


def heatmap_page(patterns: PatternsPage, *, embed_plotly: bool = True) -> str:
    """`probe heatmap`: one head's pattern at a time, with an overview of every head that selects on click."""
    heads, n_layers, n_heads = patterns["heads"], patterns["n_layers"], patterns["n_heads"]
    layers = sorted({layer for layer, _ in heads})
    per_layer = [sum(1 for at, _ in heads if at == layer) for layer in layers]
    group = per_layer[0] if len(set(per_layer)) == 1 else 1
    n, total = len(patterns["tokens"]), patterns["total_tokens"]
    real = [pair for pair in heads if pair[1] != patterns["average"]]
    shown = f"{n_layers} layers x {n_heads} heads"
    shown = shown if len(real) == n_layers * n_heads else f"{len(real)} of {shown}"
    if len(real) < len(heads):
        shown += ", and each layer's average"
    note = patterns["note"]
    body = (
        f"<h1>Attention of {esc(patterns['model'])}</h1>"
        + facts_table([("input", patterns["source"]), ("tokens", f"{n:,}" + ("" if n == total else f" of {total:,}")),
               ("heads", shown),
               ("weights", f"rounded to {patterns['decimals']} decimals; "
                           + ("keys after the query are masked (grey)" if patterns["causal"] else "no mask")),
               *precision_fact(patterns)])
        + (f'<p class="probe-note">{esc(note)}</p>' if note else "")
        + '<div class="probe-controls">'
        '<label>Layer <select class="probe-layer" aria-label="layer"></select></label>'
        '<label>Head <select class="probe-head" aria-label="head"></select></label>'
        '<label>Colour scale <select class="probe-scale" aria-label="colour scale">'
        '<option value="fixed">0 to 1</option><option value="auto">0 to the head\'s maximum</option>'
        '<option value="nobos">0 to the maximum after the first key (BOS left out)</option>'
        "</select></label></div>"
        '<div class="probe-row"><div class="probe-main"><div class="probe-plot-title"></div>'
        '<div class="probe-plot"></div>'
        '<h2>One token\'s attention over the text</h2><p class="probe-small probe-token-help">Click a token (or a '
        "row of the heatmap): the shading of every token shows how much the chosen query attends to it.</p>"
        '<div class="probe-tokens" aria-label="tokens"></div>'
        '<p class="probe-small">Queries down, keys across. Drag a box to zoom in (the token labels follow, one '
        'per row once they fit), double-click to zoom out. Hover a cell for "query → key: weight"; '
        "labels are position:token, with ␣ for a space, ↵ for a newline, ⇥ for a tab and ⟨ ⟩ around special "
        "tokens.</p></div>"
        + _overview(patterns) + "</div>"
    )
    data = {"patterns": pattern_spec(patterns, group), "tokens": list(patterns["tokens"])}  # raw: set as textContent
    return page("heatmap", f"probe heatmap: {patterns['model']}", body, data, embed_plotly=embed_plotly)


def _overview(patterns: PatternsPage) -> str:
    thumbnails = patterns.get("thumbnails")
    if thumbnails is None:
        return ""
    size, n = thumbnails.shape[-1], len(patterns["tokens"])
    how = "the whole pattern" if size == n else f"the pattern max-pooled from {n} to {size} px, so thin stripes stay"
    return ('<div class="probe-overview"><h2>All heads</h2><p class="probe-small">Rows are layers, columns heads '
            f"(avg: the layer's mean); each thumbnail is {how}. Click one to show it.</p>"
            '<div class="probe-grid"></div></div>')


def _score_grid(payload: dict[str, Any], name: str) -> list[list[float | None]]:
    """(n_layers, n_heads) scores of one class, rounded for the page; None where not finite (or null)."""
    return head_grid(payload["n_layers"], payload["n_heads"], (
        (entry["layer"], entry["head"], round(value, 4)) for entry in payload["heads"]
        if (value := entry["scores"].get(name)) is not None and math.isfinite(value)))


def _pattern_viewer(block: PatternsPage | None, flagged: list[Any], have_patterns: bool) -> str:
    """The flagged-head pattern viewer of one class section, or a hint at how to get one."""
    if block is not None and flagged:
        note = block["note"]
        return ('<div class="probe-main"><label>Flagged head <select class="probe-flagged" aria-label="flagged '
                f'head"></select></label><p class="probe-small">Pattern on {esc(block["source"])}'
                f"{' (' + esc(note) + ')' if note else ''}. Click a marked head in the grid to show "
                "it.</p><div class=\"probe-plot-title\"></div><div class=\"probe-plot\"></div></div>")
    if flagged and not have_patterns:
        return ('<p class="probe-small">Patterns of the flagged heads: <code>probe classify --html FILE</code>, '
                "or <code>classification_page(result.to_dict(), patterns=...)</code> with the "
                "<code>page_payload()</code> of each of <code>classification_patterns(loaded, result)</code>.</p>")
    return ""


def _highest(payload: dict[str, Any], name: str, threshold: float, count: int = 5) -> str:
    """Beside the grid of a class no head passes: the heads that come closest, so the reader sees how far off."""
    entries = [(entry["scores"][name], entry["layer"], entry["head"]) for entry in payload["heads"]
               if entry["scores"].get(name) is not None and math.isfinite(entry["scores"][name])]
    top = sorted(entries, key=lambda e: (-e[0], e[1], e[2]))[:count]
    names = payload.get("layer_names")
    return ('<div class="probe-main"><p class="probe-small">No head scores above the threshold '
            f"{threshold:g}; the {len(top)} highest:</p>"
            + ranked_table(["head", "score"], [[long_label(layer, head, names), f"{score:.3f}"]
                                               for score, layer, head in top]) + "</div>")


def _class_section(payload: dict[str, Any], index: int, name: str, patterns: dict[str, PatternsPage],
                   scores: list[dict[str, Any]]) -> str:
    """One class: its score grid (appended to `scores` for the page's data) and its flagged heads' viewer."""
    info = payload["classes"].get(name)
    probe = info["probe_set"] if info is not None else "natural"
    flagged = payload["flagged"][name]
    scores.append({"name": name, "probe": probe, "z": _score_grid(payload, name),
                   "flagged": [[e["layer"], e["head"], round(e["score"], 4)] for e in flagged],
                   "diagonal": None if info is None else info.get("diagonal")})
    title = esc(f"{name}: {len(flagged)} head{'s' if len(flagged) != 1 else ''} flagged "
                f"(score > {payload['thresholds'][name]:g})")
    if not flagged and not any(value for row in scores[-1]["z"] for value in row):  # e.g. next-token on a decoder
        summary = f"{info['summary']}: " if info is not None else ""
        return (f'<div class="probe-section probe-empty-class" data-score-index="{index}" data-score="{esc(name)}">'
                f"<h2>{title}</h2><p class=\"probe-meta\">{esc(summary)}every head scores 0 on this model (the class "
                "cannot apply to it), so there is no grid to show.</p></div>")
    viewer = (_pattern_viewer(patterns.get(probe), flagged, bool(patterns)) if flagged
              else _highest(payload, name, payload["thresholds"][name]))
    return (f'<div class="probe-section" data-score-index="{index}" data-score="{esc(name)}">'
            f"<h2>{title}</h2>"
            + (f'<p class="probe-meta">{esc(info["summary"])}; measured on the {esc(probe)} probe set. '
               "Red × marks flagged heads.</p>" if info is not None else "")
            + f'<div class="probe-row"><div class="probe-score-plot"></div>{viewer}</div></div>')


def classification_page(payload: dict[str, Any], patterns: dict[str, PatternsPage] | None = None, *,
                        embed_plotly: bool = True) -> str:
    """`probe classify --html`: each score's layer x head grid and, given `patterns` (probe set name ->
    `Patterns.page_payload()`), each flagged head's pattern on the input that earned its label."""
    patterns = patterns or {}
    scores: list[dict[str, Any]] = []
    sections = [_class_section(payload, index, name, patterns, scores) for index, name in enumerate(payload["flagged"])]
    model, n_layers, n_heads = payload["model"], payload["n_layers"], payload["n_heads"]
    names = payload.get("layer_names")
    rows = [("model", model), ("heads", f"{n_layers} layers x {n_heads} heads")]
    rows += [(f"probe set {name}", str(info.get("description", name))) for name, info in payload["probe_sets"].items()]
    rows += [("thresholds", ", ".join(f"{name} > {value:g}" for name, value in payload["thresholds"].items()))]
    static = static_summary("Flagged heads, highest score first", ["class", "heads (score)"],
                     [[name, ", ".join(f"{short_label(e['layer'], e['head'], names)} ({e['score']:.3f})"
                                       for e in flagged[:STATIC_HEADS])
                       + (f" and {len(flagged) - STATIC_HEADS} more" if len(flagged) > STATIC_HEADS else "")
                       if flagged else "none"] for name, flagged in payload["flagged"].items()])
    body = f"<h1>Head classification of {esc(model)}</h1>" + facts_table(rows) + static + "".join(sections)
    data = {**grid_axes(n_layers, n_heads), "scores": scores, "layer_names": names,
            "patterns": {name: pattern_spec(block, 1) for name, block in patterns.items()}}
    return page("classification", f"probe classify: {model}", body, data, embed_plotly=embed_plotly)


def _number(value: Any, what: str) -> float:
    """A number of the payload; NaN, infinity and None (how strict JSON writes them) become NaN."""
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProbeError(f"ablation result: {what} must be a number, got {value!r}")
    return float(value) if math.isfinite(float(value)) else math.nan


def _index(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ProbeError(f"ablation result: {what} must be a non-negative integer, got {value!r}")
    return value


def _ablation_entries(result: Any) -> list[tuple[int, int, float, float]]:
    """(layer, head, loss, delta) of every single-head entry of an ablation payload, checked."""
    if not isinstance(result, dict):
        raise ProbeError(f"ablation result must be a dict, got {type(result).__name__}")
    missing = [key for key in ("model", "method", "baseline_loss", "heads") if key not in result]
    if missing:
        raise ProbeError(f"ablation result has no {missing[0]!r}: expected model, method, data, baseline_loss, "
                         "heads")
    heads = result["heads"]
    if not isinstance(heads, list) or not heads:
        raise ProbeError("ablation result has no heads to show")
    entries = []
    for i, item in enumerate(heads):
        if not isinstance(item, dict) or any(key not in item for key in ("layer", "head", "loss", "delta")):
            raise ProbeError(f"ablation result: heads[{i}] must have layer, head, loss and delta")
        entries.append((_index(item["layer"], f"heads[{i}].layer"), _index(item["head"], f"heads[{i}].head"),
                        _number(item["loss"], f"heads[{i}].loss"), _number(item["delta"], f"heads[{i}].delta")))
    return entries


def _ablation_data(entries: list[tuple[int, int, float, float]], n_layers: int, n_heads: int,
                   top: int, names: LayerNames = None) -> dict[str, Any]:
    """Grids of delta and loss (None: not ablated, or not finite) and the `top` heads by |delta|."""
    finite = [entry for entry in entries if math.isfinite(entry[2]) and math.isfinite(entry[3])]
    z = head_grid(n_layers, n_heads, ((layer, head, round(delta, 6)) for layer, head, _, delta in finite))
    loss = head_grid(n_layers, n_heads, ((layer, head, round(value, 6)) for layer, head, value, _ in finite))
    ranked = sorted(finite, key=lambda e: -abs(e[3]))[:top]
    top_data = {"label": [short_label(layer, head, names) for layer, head, _, _ in ranked],
                "name": [long_label(layer, head, names) for layer, head, _, _ in ranked],
                "delta": [round(delta, 6) for _, _, _, delta in ranked],
                "loss": [round(head_loss, 6) for _, _, head_loss, _ in ranked],
                "color": ["#b2182b" if delta >= 0 else "#2166ac" for _, _, _, delta in ranked]}
    return {**grid_axes(n_layers, n_heads), "z": z, "loss": loss, "top": top_data, "layer_names": names}


def _estimate_marks(result: dict[str, Any], data: dict[str, Any], n_layers: int, n_heads: int) -> str:
    """An estimate's values marked exact or estimated in `data`; its "N ablated exactly, M estimated" ("" if none)."""
    if result.get("mode") != "estimate":
        return ""
    how: list[list[str | None]] = [[None] * n_heads for _ in range(n_layers)]
    by_label = {}
    for entry in result["heads"]:
        value = how[entry["layer"]][entry["head"]] = "ablated exactly" if entry.get("exact") else "estimated"
        by_label[short_label(entry["layer"], entry["head"], result.get("layer_names"))] = value
    data["how"] = how
    data["top"]["how"] = [by_label[label] for label in data["top"]["label"]]
    exact = sum(1 for entry in result["heads"] if entry.get("exact"))
    return f"{exact} ablated exactly, {len(result['heads']) - exact} estimated,"


def _ablation_static(data: dict[str, Any], estimate: bool) -> str:
    top = data["top"]
    columns = ["head", "Δ loss", "loss"] + (["value"] if estimate else [])
    rows = [[label, f"{delta:+.4f}", f"{loss:.4f}"] + ([top["how"][i]] if estimate else [])
            for i, (label, delta, loss) in enumerate(zip(top["label"], top["delta"], top["loss"]))]
    return static_summary("The heads that matter most, by |Δ loss|", columns, rows[:STATIC_HEADS])


def _estimate_note(result: dict[str, Any]) -> str:
    """How an estimate was made, above its plots."""
    return ('<p class="probe-note probe-estimate-note"><b>Estimated values.</b> Most deltas on this page are '
            "estimates, not ablations: attribution patching (Syed et al. 2023; Kramar et al. 2024) takes each head's "
            "first-order term -&lt;dL/dz, z&gt; from one forward and one backward pass, plus a Gauss-Newton "
            "second-order term from a sampled backward pass; then the top-estimated heads were ablated exactly as "
            "the budget allowed. Hatched bars and hovers marked “estimated” are estimates; “ablated exactly” are "
            f"measured. How: {esc(result.get('path', ''))}. Measured target: Spearman ≥ 0.9 against the exact sweep "
            "within 10 forward-equivalents; the top 10 can differ: run the exact sweep (without --method estimate) "
            "for numbers to report.</p>")


def _effects_data(result: dict[str, Any]) -> dict[str, Any] | None:
    """The effects scatter's data: per head its mean delta, specificity and top tokens; None without effects."""
    heads = [entry for entry in result["heads"] if isinstance(entry.get("effects"), dict) and entry["effects"]]
    if not heads:
        return None
    out: dict[str, list[Any]] = {"label": [], "name": [], "delta": [], "specificity": [], "max_token": [],
                                 "tokens": []}
    for i, entry in enumerate(heads):
        effects = entry["effects"]
        out["label"].append(short_label(entry["layer"], entry["head"], result.get("layer_names")))
        out["name"].append(long_label(entry["layer"], entry["head"], result.get("layer_names")))
        out["delta"].append(_number(entry["delta"], f"heads[{i}].delta"))
        out["specificity"].append(_number(effects.get("specificity"), f"heads[{i}].effects.specificity"))
        out["max_token"].append(_number(effects.get("max_token_delta"), f"heads[{i}].effects.max_token_delta"))
        tokens = []
        for token in effects.get("top_tokens") or []:
            context = str(token.get("context", ""))
            cut = context.rfind("[")
            tokens.append({"before": context[:cut] if cut >= 0 else context, "token": context[cut:] if cut >= 0 else "",
                           "delta": _number(token.get("delta"), f"heads[{i}] top token delta"),
                           "sequence": token.get("sequence")})
        out["tokens"].append(tokens)
    for key in ("delta", "specificity", "max_token"):  # strict JSON: no NaN
        out[key] = [None if math.isnan(v) else round(v, 6) for v in out[key]]
    return out


EFFECTS = ('<div class="probe-section"><h2>Mean effect against specificity</h2><p class="probe-small">One point '
           "per head: x its mean Δ, y its specificity (the share of its loss increase on the top 1% of tokens). "
           "Click a point to see the tokens that head affects most, in their text.</p>"
           '<div class="probe-row"><div class="probe-scatter-plot"></div>'
           '<div class="probe-main"><h3 class="probe-tokens-title">Top affected tokens</h3>'
           '<div class="probe-tokens"></div></div></div></div>')  # the scatter of an ablation with effects


def ablation_page(result: dict[str, Any], *, embed_plotly: bool = True, top: int = TOP_HEADS) -> str:
    """`probe ablate --html` from an ablation payload or JSON (n_layers / n_heads may be absent): the heatmap of
    loss deltas and the `top` heads by |delta|; a head whose loss or delta is not finite is left blank."""
    entries = _ablation_entries(result)
    n_layers = result.get("n_layers") or max(e[0] for e in entries) + 1
    n_heads = result.get("n_heads") or max(e[1] for e in entries) + 1
    n_layers, n_heads = _index(n_layers, "n_layers"), _index(n_heads, "n_heads")
    if any(layer >= n_layers or head >= n_heads for layer, head, _, _ in entries):
        raise ProbeError(f"ablation result: a head lies outside {n_layers} layers x {n_heads} heads")
    data = _ablation_data(entries, n_layers, n_heads, top, result.get("layer_names"))
    data["effects"] = _effects_data(result)
    broken = sum(1 for _, _, head_loss, delta in entries if not (math.isfinite(head_loss) and math.isfinite(delta)))
    baseline = _number(result["baseline_loss"], "baseline_loss")
    estimate = _estimate_marks(result, data, n_layers, n_heads)
    rows = [("model", str(result["model"])), ("method", f"{result['method']} ablation, one head at a time"
                                              + (", estimated (see below)" if estimate else "")),
            ("data", str(result.get("data", ""))), ("baseline loss", f"{baseline:.4f}"),
            ("heads", (estimate or f"{len(entries)} ablated") + f" of {n_layers} layers x {n_heads} heads"
                      + (f"; {broken} with a loss that is not a finite number (blank)" if broken else ""))]
    body = (
        f"<h1>Head ablation of {esc(result['model'])}</h1>" + facts_table(rows)
        + (_estimate_note(result) if estimate else "")
        + _ablation_static(data, estimate != "")
        + '<div class="probe-row"><div><h2>Δ loss per head</h2><p class="probe-small">Red: the loss rises when '
        "the head is ablated (the head helps); blue: it falls. Blank: not ablated.</p>"
        '<div class="probe-delta-plot"></div></div>'
        f'<div class="probe-main"><h2>The {len(data["top"]["label"])} heads that matter most</h2>'
        '<p class="probe-small">By |Δ loss|, largest first.</p><div class="probe-bar-plot"></div></div></div>'
        + (EFFECTS if data["effects"] is not None else "")
    )
    return page("ablation", f"probe ablate: {result['model']}", body, data, embed_plotly=embed_plotly)


def _flat(data: dict[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    """("model.sha256", "ab12...") rows of a nested dict; None shown as a dash."""
    rows: list[tuple[str, str]] = []
    for key, value in data.items():
        if isinstance(value, dict):
            rows += _flat(value, f"{prefix}{key}.")
        else:
            rows.append((f"{prefix}{key}", "–" if value is None else str(value)))
    return rows


def provenance_block(provenance: dict[str, Any]) -> str:
    """What produced the page: a closed <details> table, and the same as JSON (`#probe-provenance`) for a script."""
    return ('<details class="probe-provenance" style="font: 0.85em system-ui, sans-serif; color: #555; '
            'max-width: 1500px; margin: 12px auto; padding: 0 16px;"><summary>Provenance: how this page was made'
            "</summary>" + facts_table(_flat(provenance))
            + f'</details>\n<script type="application/json" id="probe-provenance">{script_json(provenance)}'
            "</script>\n")

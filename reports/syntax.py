"""`probe syntax`'s terminal report, CSV rows and page, from `SyntaxResult.to_dict()`."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from probe.reports.html import asset_script, esc, facts_table, page
from probe.reports.terminal import layer_grid, print_precision, table
from probe.reports.labels import column_label, precision_fact, short_label

SHOWN_HEADS = 3  # best heads per relation in the terminal
SHOWN_SYNTACTIC = 25  # heads listed in the overview


def relation_table(payload: dict[str, Any]) -> Table:
    """Per judged relation and direction: arcs, the best fixed offset, and the best heads with their margins."""
    columns = ("relation", "direction", "arcs", "baseline", "best heads: accuracy (margin)")
    grid = table(*columns, left=columns[:2] + columns[-1:], title="Best heads per relation", title_justify="left",
                 title_style="bold")
    for entry in payload["relations"]:
        if not entry["judged"]:
            continue
        heads = Text()
        for best in entry["best"][:SHOWN_HEADS]:
            good = best["margin"] > payload["margin"]
            heads.append(f"{short_label(best['layer'], best['head'])} {best['accuracy']:.2f} ({best['margin']:+.2f})  ",
                         style="bold green" if good else "")
        grid.add_row(entry["relation"], entry["direction"], str(entry["count"]),
                     f"{entry['baseline']:.2f} @{entry['baseline_offset']:+d}", heads)
    return grid


def syntax_report(payload: dict[str, Any], console: Console) -> None:
    """The relations with their best heads, then which heads are syntactic for which relations."""
    console.print(Text(f"Syntactic heads of {payload['model']}", style="bold"),
                  Text(f"({payload['n_layers']} layers x {payload['n_heads']} heads)"))
    console.print(Text(f"  parses: {payload['source']}; {payload['sentences']} sentences, {payload['words']} words; "
                       f"label scheme {payload['scheme']}: {payload['scheme_title']}", style="dim"))
    how = ("causal model: each arc scored from its later word, earlier words only (Vig & Belinkov 2019)"
           if payload["causal"] else "both directions of every arc (Clark et al. 2019)")
    console.print(Text(f"  {how}; syntactic: accuracy > baseline + {payload['margin']:g} on relations with "
                       f">= {payload['min_count']} arcs", style="dim"))
    for line in payload["skipped"]:
        console.print(Text(f"  {line}", style="yellow"))
    console.print()
    console.print(relation_table(payload))
    rare = [f"{e['relation']} {e['direction']} ({e['count']})" for e in payload["relations"] if not e["judged"]]
    if rare:
        console.print(Text(f"  too few arcs to judge: {', '.join(rare)}", style="dim"))
    console.print()
    heads = sorted(payload["syntactic"], key=lambda e: (-len(e["relations"]), e["layer"], e["head"]))
    console.print(Text(f"Syntactic heads: {len(heads)} of {payload['n_layers'] * payload['n_heads']}", style="bold"))
    for entry in heads[:SHOWN_SYNTACTIC]:
        console.print(Text(f"  {short_label(entry['layer'], entry['head']):>6}  {', '.join(entry['relations'])}"))
    if len(heads) > SHOWN_SYNTACTIC:
        console.print(Text(f"  ... and {len(heads) - SHOWN_SYNTACTIC} more (see --json)", style="dim"))
    console.print(Text("Overview, layer x head: relations each head is syntactic for", style="bold"))
    console.print(syntactic_grid(payload))
    share = payload["confident"]["share"]
    ranked = sorted(((share[layer][h], layer, h) for layer in range(len(share)) for h in range(len(share[layer]))),
                    reverse=True)
    console.print(Text(f"Most confident attention on arcs (weights > {payload['confident']['threshold']:g}, BOS "
                       "excluded; Vig & Belinkov 2019): ", style="bold"),
                  Text(", ".join(f"{short_label(layer, h)} {v:.2f}" for v, layer, h in ranked[:5])))
    print_precision(payload, console)


def syntactic_grid(payload: dict[str, Any]) -> Table:
    """Layer x head: for how many relation-directions each head is syntactic (· for none)."""
    counts = {(e["layer"], e["head"]): len(e["relations"]) for e in payload["syntactic"]}
    return layer_grid({**payload, "layer_names": None}, lambda layer, head: Text(
        str(counts[layer, head]) if counts.get((layer, head)) else "", style="bold"))


def syntax_rows(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """CSV: one row per relation, direction and head."""
    rows = []
    for entry in payload["relations"]:
        for layer, accuracies in enumerate(entry["accuracy"]):
            for head, accuracy in enumerate(accuracies):
                margin = round(accuracy - entry["baseline"], 4)
                rows.append({"relation": entry["relation"], "direction": entry["direction"], "arcs": entry["count"],
                             "judged": entry["judged"], "baseline": entry["baseline"],
                             "baseline_offset": entry["baseline_offset"], "name": column_label(layer, head),
                             "layer": layer, "head": head,
                             "accuracy": accuracy, "margin": margin,
                             "syntactic": entry["judged"] and margin > payload["margin"]})
    return rows


def _grid(payload: dict[str, Any]) -> dict[str, Any]:
    """Rows: judged relation-directions; columns: every head; values: accuracy minus the relation's baseline."""
    rows, z = [], []
    for entry in payload["relations"]:
        if entry["judged"]:
            rows.append(f"{entry['relation']} {entry['direction']} ({entry['count']})")
            z.append([round(value - entry["baseline"], 4) for layer in entry["accuracy"] for value in layer])
    heads = [short_label(layer, head) for layer in range(payload["n_layers"]) for head in range(payload["n_heads"])]
    return {"rows": rows, "z": z, "heads": heads}


def syntax_page(payload: dict[str, Any]) -> str:
    """`probe syntax --html`: the relation x head map and, for a chosen head and sentence, the arcs it gets right."""
    syntactic = sorted(payload["syntactic"], key=lambda e: (-len(e["relations"]), e["layer"], e["head"]))
    named = {(e["layer"], e["head"]) for e in syntactic}
    order = [[e["layer"], e["head"], ", ".join(e["relations"])] for e in syntactic]
    order += [[layer, head, ""] for layer in range(payload["n_layers"]) for head in range(payload["n_heads"])
              if (layer, head) not in named]
    how = ("each arc from its later word, earlier words only" if payload["causal"] else "both directions")
    rows = [("model", payload["model"]), ("parses", payload["source"]),
            ("label scheme", f"{payload['scheme']}: {payload['scheme_title']}"),
            ("sentences", f"{payload['sentences']} ({payload['words']} words)"),
            ("scoring", f"{how}; syntactic: accuracy > baseline + {payload['margin']:g}, relations with >= "
                        f"{payload['min_count']} arcs")]
    rows += [("skipped", line) for line in payload["skipped"]] + precision_fact(payload)
    body = (f"<h1>Syntactic heads of {esc(payload['model'])}</h1>" + facts_table(rows)
            + "<h2>Accuracy above the best fixed-offset baseline, per relation and head</h2>"
            '<div class="probe-syntax-plot"></div>'
            "<h2>Arcs one head gets right</h2>"
            '<div class="probe-controls"><label>Head <select class="probe-syntax-head" aria-label="head"></select>'
            '</label><label>Sentence <select class="probe-sentence" aria-label="sentence"></select></label>'
            '<span class="probe-arc-count probe-small"></span></div>'
            '<div class="probe-arcs-box" style="overflow-x:auto"></div>'
            '<p class="probe-small">Green: the head\'s strongest attention from the query word lands on the gold '
            "word; grey, dashed: it does not. Hover an arc for its relation.</p>"
            + asset_script("syntax.js"))
    data = {"grid": _grid(payload), "examples": payload["examples"], "n_heads": payload["n_heads"],
            "head_order": order}
    return page("syntax", f"probe syntax: {payload['model']}", body, data, embed_plotly=True)

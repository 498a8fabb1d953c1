"""`probe qk`'s terminal report, CSV rows and page, from `QKAttribution.to_dict()`."""

from __future__ import annotations

from typing import Any, Literal

from rich.console import Console
from rich.text import Text

from probe.reports.html import asset_script, esc, facts_table, page, ranked_table
from probe.reports.terminal import print_precision, table
from probe.reports.labels import precision_fact

SHOWN = 16  # components per side drawn in the page's matrix (the rest summed into "other")
View = Literal["score", "contrast"]
VIEWS: dict[View, str] = {"score": "the score",
                          "contrast": "the contrast (the key's score minus the mean of the other keys')"}


def _name(payload: dict[str, Any], index: int) -> str:
    return str(payload["components"][index]["name"])


def qk_rows(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """One CSV row per component pair, largest |score| first; layer and head -1 where the component has none."""
    components, views = payload["components"], payload["views"]
    size = len(components)
    cells = sorted(((i, j) for i in range(size) for j in range(size)),
                   key=lambda cell: -abs(views["score"]["matrix"][cell[0]][cell[1]]))

    def side(name: str, component: dict[str, Any]) -> dict[str, Any]:
        return {name: component["name"], f"{name}_layer": -1 if component["layer"] is None else component["layer"],
                f"{name}_head": -1 if component["head"] is None else component["head"]}

    return [{"rank": rank, **side("query", components[i]), **side("key", components[j]),
             "score": views["score"]["matrix"][i][j], "contrast": views["contrast"]["matrix"][i][j]}
            for rank, (i, j) in enumerate(cells, start=1)]


def _title(payload: dict[str, Any]) -> str:
    return f"QK attribution of head {payload['layer']}.{payload['head']} of {payload['model']}"


def _keys_read(payload: dict[str, Any]) -> str:
    if payload["rule"] == "positions":
        return f"query {payload['query']}, key {payload['key']}"
    return f"every query at its {payload['rule']} key"


def _check_line(view: dict[str, Any], what: str) -> str:
    return (f"{what}: the model's own mean {view['model_score']:+.4f}, the pairs' sum {view['sum']:+.4f} over "
            f"{view['points']} points; largest |pairs - model's own| {view['max_residual']:.2e} (its rounding allows "
            f"{view['rounding_bound']:.2e})")


def _largest(values: list[float], top: int) -> list[int]:
    return sorted(range(len(values)), key=lambda index: -abs(values[index]))[:top]


def _side(payload: dict[str, Any], values: list[float], top: int) -> str:
    return "  ".join(f"{_name(payload, index)} {values[index]:+.3f}" for index in _largest(values, top))


def qk_report(payload: dict[str, Any], console: Console, *, top: int = 10) -> None:
    """Per view: the top pairs, each side's top components, the groups, and the check."""
    console.print(Text(_title(payload), style="bold"),
                  Text(f"({payload['source']}; {_keys_read(payload)}; key/value head {payload['kv_head']})"))
    for name, what in VIEWS.items():
        view = payload["views"][name]
        rows = [[str(rank), _name(payload, pair["query"]), _name(payload, pair["key"]), f"{pair['value']:+.3f}",
                 f"{pair['value'] / view['model_score'] if view['model_score'] else float('nan'):+.1%}"]
                for rank, pair in enumerate(view["top_pairs"][:top], start=1)]
        console.print(table("rank", "query side", "key side", "contribution", f"share of {view['model_score']:+.3f}",
                            left=("query side", "key side"), title=f"Pairs of {what}", title_justify="left", rows=rows))
        console.print(Text(f"key side: {_side(payload, view['key'], 5)}"))
        console.print(Text(f"query side: {_side(payload, view['query'], 5)}"))
        kinds = "  ".join(f"{group['group']} {group['query']:+.3f} / {group['key']:+.3f}"
                          for group in view["groups"]["kind"])
        console.print(Text(f"by kind (query / key): {kinds}", style="dim"))
        console.print(Text(_check_line(view, name), style="bold"))
    console.print(Text("Each pair: a query-side component at the query dotted with a key-side component at the key "
                       "(times the scaling), each read through the norm frozen at the run and rotated, where the model "
                       "rotates, at its own position", style="dim"))
    print_precision(payload, console)


def _shown(payload: dict[str, Any], view: dict[str, Any]) -> dict[str, Any]:
    """The matrix of the SHOWN components of largest |marginal| on each side, the rest summed into "other"."""
    rows, cols = _largest(view["query"], SHOWN), _largest(view["key"], SHOWN)
    matrix = view["matrix"]
    rest_rows = [index for index in range(len(matrix)) if index not in rows]
    rest_cols = [index for index in range(len(matrix)) if index not in cols]

    def cell(row_set: list[int], col_set: list[int]) -> float:
        return round(sum(matrix[i][j] for i in row_set for j in col_set), 6)

    row_sets = [[index] for index in rows] + ([rest_rows] if rest_rows else [])
    col_sets = [[index] for index in cols] + ([rest_cols] if rest_cols else [])
    return {"query_labels": [_name(payload, index) for index in rows] + (["other"] if rest_rows else []),
            "key_labels": [_name(payload, index) for index in cols] + (["other"] if rest_cols else []),
            "z": [[cell(row_set, col_set) for col_set in col_sets] for row_set in row_sets],
            "query_marginal": [round(sum(view["query"][i] for i in row_set), 6) for row_set in row_sets],
            "key_marginal": [round(sum(view["key"][j] for j in col_set), 6) for col_set in col_sets]}


def _section(payload: dict[str, Any], name: View) -> str:
    view = payload["views"][name]
    pairs = [[str(rank), _name(payload, pair["query"]), _name(payload, pair["key"]), f"{pair['value']:+.4f}"]
             for rank, pair in enumerate(view["top_pairs"], start=1)]
    groups = [[entry["group"], f"{entry['query']:+.4f}", f"{entry['key']:+.4f}"]
              for grouping in ("kind", "layer") for entry in view["groups"][grouping]]
    return (f'<div class="probe-section"><h2>Pairs of {esc(VIEWS[name])}</h2>'
            f'<p class="probe-small">{esc(_check_line(view, name))}</p>'
            f'<div class="probe-qk-matrix" data-view="{esc(name)}"></div>'
            '<div class="probe-row"><div class="probe-grow"><h3>Largest pairs</h3>'
            + ranked_table(["rank", "query side", "key side", "contribution"], pairs)
            + '</div><div class="probe-grow"><h3>Grouped (kind, then layer)</h3>'
            + ranked_table(["group", "query side", "key side"], groups) + "</div></div></div>")


def qk_page(payload: dict[str, Any]) -> str:
    """`probe qk --html`: per view the pair matrix with its marginals, the top pairs and the grouped views."""
    facts = [("model", str(payload["model"])), ("data", str(payload["source"])),
             ("head", f"{payload['layer']}.{payload['head']} (key/value head {payload['kv_head']})"),
             ("keys read", _keys_read(payload))] + precision_fact(payload)
    data = {"views": {name: _shown(payload, payload["views"][name]) for name in VIEWS}}
    body = (f"<h1>{esc(_title(payload))}</h1>" + facts_table(facts)
            + "".join(_section(payload, name) for name in VIEWS) + asset_script("qk.js"))
    return page("qk", f"probe qk: {payload['model']}", body, data, embed_plotly=True)

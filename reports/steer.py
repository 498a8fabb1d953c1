"""`probe steer`'s terminal report and page, from `SteerResult.to_dict()`."""

from __future__ import annotations

from pathlib import PurePath
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from probe.errors import ProbeError
from probe.reports.html import asset_script, esc, facts_table, page, plotly_text, static_summary
from probe.reports.terminal import print_precision, table
from probe.reports.labels import long_label, short_label


def _number(value: Any) -> str:
    return "nan" if value is None else f"{value:.4f}"


HEADER = 100  # characters of the terminal report's first line at most


def _measure(payload: dict[str, Any]) -> str:
    """What the values are: the logit difference itself (a metric that is minus it, read forwards), or the metric."""
    return str(payload.get("measure") or payload["metric"])


def header_line(payload: dict[str, Any], flag: str = "--values") -> str:
    """The report's first line, at most HEADER characters (the model by its file's name where its path is too
    long)."""
    what = (f": {_measure(payload)} at each of {flag} ({payload['intervention']}'s {payload['parameter']})"
            if payload["curves"] else "")
    line = f"Steering heads of {payload['model']}{what}"
    if len(line) > HEADER:
        line = f"Steering heads of {PurePath(str(payload['model'])).name}{what}"
    return line if len(line) <= HEADER else line[:HEADER - 3] + "..."


def details(payload: dict[str, Any]) -> list[tuple[str, str]]:
    """What the header leaves out: the input, what is measured, the intervention, the model as it is."""
    figures = _figures(payload.get("baseline_figures"))
    measure, metric = _measure(payload), str(payload["metric"])
    reads = (f"the {measure} itself, higher = more of the behaviour (the metric {metric} is minus it: "
             f"{payload['metric_description']})" if measure != metric else f"{metric}, {payload['metric_description']}")
    return [("input", str(payload["data"])), ("measured", reads),
            ("intervention", f"{payload['intervention']}, its {payload['parameter']} set to each value"),
            ("as it is", _number(payload["baseline"]) + (f"; {figures}" if figures else ""))]


def _figures(figures: dict[str, Any] | None) -> str:
    """A task's margin and accuracy, shown beside its metric (nothing for text)."""
    if not figures:
        return ""
    return ", ".join(f"{name} {_number(value)}" for name, value in figures.items())


def _word(flag: str) -> str:
    """What a column calls one of the flag's values: value (--values), alpha (--alpha)."""
    return flag.lstrip("-").removesuffix("s")


def _curve_table(payload: dict[str, Any], flag: str) -> Table:
    names = payload.get("layer_names")
    grid = table("head", *(f"{_word(flag)} {value:g}" for value in payload["values"]))
    for curve in payload["curves"]:
        grid.add_row(short_label(curve["layer"], curve["head"], names),
                     *(_number(point["value"]) for point in curve["points"]))
    return grid


def _find_table(payload: dict[str, Any], find: dict[str, Any], top: int, flag: str) -> Table:
    names = payload.get("layer_names")
    grid = table("rank", "head", f"{_measure(payload)} at {_word(flag)} {find['setting']:g}", "change", "figures",
                 left=("figures",))
    for rank, entry in enumerate(find["ranking"][:top], start=1):
        grid.add_row(str(rank), short_label(entry["layer"], entry["head"], names), _number(entry["value"]),
                     "nan" if entry["delta"] is None else f"{entry['delta']:+.4f}", _figures(entry.get("figures")))
    return grid


def _generations(payload: dict[str, Any], generated: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(head, value, text) of each continuation, the model as it is first."""
    names = payload.get("layer_names")
    return [("as it is", "", generated["baseline"])] + [
        (short_label(row["layer"], row["head"], names), f"{row['setting']:g}", row["text"])
        for row in generated["rows"]]


def _generation_table(payload: dict[str, Any], generated: dict[str, Any], flag: str) -> Table:
    grid = table("head", _word(flag))
    grid.add_column(f"continuation of {generated['prompt']!r}", overflow="fold")
    for head, value, text in _generations(payload, generated):
        grid.add_row(head, value, repr(text))
    return grid


def steer_report(payload: dict[str, Any], console: Console, *, top: int = 15, flag: str = "--values") -> None:
    """The curves, the ranking, the continuations and the details; `flag` (--values, --alpha) names the values."""
    console.print(Text(header_line(payload, flag), style="bold"))
    if payload["curves"]:
        console.print(_curve_table(payload, flag))
    find, generated = payload.get("find"), payload.get("generations")
    if find:
        console.print(Text(f"Every head alone under {payload['intervention']} at {payload['parameter']} "
                           f"{find['setting']:g}, largest change first ({find['path']})", style="bold"))
        console.print(_find_table(payload, find, top, flag))
    if generated:
        console.print(Text(f"Greedy continuations, {generated['max_new_tokens']} tokens", style="bold"))
        console.print(_generation_table(payload, generated, flag))
    for name, text in details(payload):  # under the tables, one line each
        console.print(Text(f"{name[:1].upper() + name[1:]}: {text}.", style="dim"))
    print_precision(payload, console)


def steer_data(payload: dict[str, Any]) -> dict[str, Any]:
    """The page's plot data: one line per head, and --find's top bars."""
    if "values" not in payload or "curves" not in payload:
        raise ProbeError("not a steering result (no values or curves)")
    names = payload.get("layer_names")
    lines = [{"label": plotly_text(short_label(c["layer"], c["head"], names)),
              "name": plotly_text(long_label(c["layer"], c["head"], names)),
              "setting": [p["setting"] for p in c["points"]], "value": [p["value"] for p in c["points"]]}
             for c in payload["curves"]]
    find = payload.get("find")
    bars = None if not find else {
        "setting": find["setting"],
        "labels": [plotly_text(short_label(e["layer"], e["head"], names)) for e in find["ranking"][:30]],
        "delta": [e["delta"] for e in find["ranking"][:30]]}
    return {"metric": plotly_text(_measure(payload)), "parameter": plotly_text(str(payload["parameter"])),
            "intervention": plotly_text(str(payload["intervention"])), "baseline": payload["baseline"],
            "lines": lines, "bars": bars}


def _generation_rows(payload: dict[str, Any]) -> str:
    generated = payload.get("generations")
    if not generated:
        return ""
    text_cell = '<td class="probe-steer-text" style="white-space: pre-wrap">'  # the text as generated
    body = "".join(f"<tr><td>{esc(head)}</td><td>{esc(value)}</td>{text_cell}{esc(text)}</td></tr>"
                   for head, value, text in _generations(payload, generated))
    return (f"<h2>Greedy continuations of <q>{esc(generated['prompt'])}</q></h2>"
            '<table class="probe-static-table probe-steer-generations"><tr><th>head</th>'
            f"<th>{esc(payload['parameter'])}</th>"
            f"<th>continuation ({generated['max_new_tokens']} tokens)</th></tr>{body}</table>")


def steer_page(payload: dict[str, Any]) -> str:
    """`probe steer --html`: self-contained and offline, every text escaped."""
    data = steer_data(payload)
    measure = _measure(payload)
    rows = [("model", str(payload["model"])), ("dtype", str(payload.get("dtype"))), ("data", str(payload["data"])),
            *details(payload)]
    parameter = str(payload["parameter"])  # what the values are: scale's alpha
    summary = static_summary(f"{measure} against {parameter}",
                             ["head", *(f"{parameter} {v:g}" for v in payload["values"])],
                             [[line["label"], *(_number(v) for v in line["value"])] for line in data["lines"]])
    body = (f"<h1>Steering heads of {esc(payload['model'])}</h1>" + facts_table(rows)
            + (f"<h2>{esc(measure[:1].upper() + measure[1:])} against {esc(parameter)}</h2>" + summary
               + '<div class="probe-steer-curves"></div>' if data["lines"] else "")
            + (f"<h2>Every head under {esc(payload['intervention'])} at {esc(parameter)} "
               f"{data['bars']['setting']:g}: the largest changes</h2>"
               '<div class="probe-steer-find"></div>' if data["bars"] else "")
            + _generation_rows(payload) + asset_script("steer.js"))
    return page("steer", f"probe steer: {payload['model']}", body, data, embed_plotly=True)

"""Terminal and CSV rows of `Circuits.to_dict()` (probe circuits): induction heads and the heads that feed them."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.text import Text

from probe.reports.html import esc, facts_table, page, ranked_table
from probe.reports.terminal import print_precision, table
from probe.reports.labels import column_label, precision_fact, short_label


FEEDERS = "feeders by K-composition (P: previous-token head)"
DELTAS = ("ablated feeder", "Δ feeder", "Δ induction", "Δ together", "interaction")
DELTA_NOTE = ("Δ: loss change on the second copy of the repeated set (zero ablation); interaction: Δ together - "
              "Δ feeder - Δ induction (< 0: the two do one job)")
PAIRS = "previous-token -> induction pairs"


def circuit_rows(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """One CSV row per (induction head, feeder), the pair's deltas where it was checked."""
    rows = []
    for pair in payload["induction_heads"]:
        deltas = pair["second_copy_deltas"]
        for rank, feeder in enumerate(pair["feeders"], start=1):
            checked = pair["checked"] == {"layer": feeder["layer"], "head": feeder["head"]}
            rows.append({"name": column_label(pair["layer"], pair["head"]), "layer": pair["layer"],
                         "head": pair["head"], "induction_score": pair["induction_score"], "rank": rank,
                         "feeder_name": column_label(feeder["layer"], feeder["head"]), "feeder_layer": feeder["layer"],
                         "feeder_head": feeder["head"],
                         "k_composition": feeder["k_composition"], "rank_in_layer": feeder["rank_in_layer"],
                         "previous_token": feeder["previous_token"],
                         "delta_feeder": deltas.get("feeder") if checked else None,
                         "delta_induction": deltas.get("induction") if checked else None,
                         "delta_together": deltas.get("together") if checked else None})
    return rows


def _pairs(payload: dict[str, Any]) -> str:
    summary = payload["previous_token_pairs"]
    return (f"{summary['pairs']}; the previous-token head composes most strongly of its layer in "
            f"{summary['ranked_first_in_layer']}, above the baseline in {summary['above_baseline']}")


def _delta(value: Any) -> str:
    return "" if value is None else f"{value:+.3f}"


def _rows(payload: dict[str, Any], between: str) -> list[list[str]]:
    """Per induction head: its feeders (joined by `between`), the feeder ablated with it, and the loss changes."""
    rows = []
    for pair in payload["induction_heads"]:
        feeders = between.join(f"{short_label(f['layer'], f['head'])}{' P' if f['previous_token'] else ''} "
                               f"{f['k_composition']:.3f}" for f in pair["feeders"])
        deltas, checked = pair["second_copy_deltas"], pair.get("checked")
        rows.append([short_label(pair["layer"], pair["head"]), feeders,
                     "" if not checked else short_label(checked["layer"], checked["head"]),
                     _delta(deltas.get("feeder")), _delta(deltas.get("induction")), _delta(deltas.get("together")),
                     _delta(pair["interaction"])])
    return rows


def circuits_report(payload: dict[str, Any], console: Console) -> None:
    """Per induction head: its strongest K-composing earlier heads, and the pair ablated together vs alone."""
    console.print(Text(f"Induction circuits of {payload['model']}", style="bold"),
                  Text(f"(K-composition; random baseline {payload['random_baseline']:.3f}; rotary ignored)"))
    console.print(table("induction", FEEDERS, *DELTAS, left=(FEEDERS,), rows=_rows(payload, "  ")))
    console.print(Text(f"{PAIRS}: {_pairs(payload)}", style="bold"))
    console.print(Text(DELTA_NOTE, style="dim"))
    print_precision(payload, console)


def circuits_page(payload: dict[str, Any]) -> str:
    """`probe circuits --html`: the terminal's table and the run's facts; nothing to draw."""
    facts = [("model", str(payload["model"])), ("random baseline", f"{payload['random_baseline']:.3f} "
              "(K-composition of random matrices of the same shapes; rotary ignored)"),
             (PAIRS, _pairs(payload))] + precision_fact(payload)
    rows = _rows(payload, ", ")
    table = (ranked_table(["induction head", FEEDERS, *DELTAS], rows, text=(1,), kind="probe-circuits") if rows
             else '<p class="probe-small">No induction head found.</p>')
    body = (f"<h1>Induction circuits of {esc(payload['model'])}</h1>" + facts_table(facts) + "<h2>Induction heads "
            f'and the heads feeding their keys</h2>{table}<p class="probe-small">{esc(DELTA_NOTE)}.</p>')
    return page("circuits", f"probe circuits: {payload['model']}", body, {}, embed_plotly=True)

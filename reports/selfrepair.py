"""The self-repair section of `probe patch` and `probe dla` (`SelfRepair.to_dict()`): table, grid and page table."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.text import Text

from probe.reports.html import esc, plain_table, rounded_grid
from probe.reports.terminal import table
from probe.reports.labels import short_label

TOP = 15  # ablated heads listed, largest |direct| first
HEADER = ["head", "total", "direct", "self-repair", "repaired", "heads", "MLPs", "norm", "covered by"]

EXPLAINED = ("total: the score's change with the head ablated; direct: its own path to the logits (the final norm "
             "frozen at the clean run); self-repair = total - direct (> 0: the rest of the model makes up for the "
             "head); repaired: self-repair / -direct, the share of the direct effect given back (shown where |direct| "
             "is at least {floor:.0%} of the largest: below it, total - direct is the head's indirect effect, not a "
             "repair); heads, MLPs, norm: where self-repair comes from (later heads' DLA, the MLPs', the final "
             "norm's rescaling); covered by: the later heads whose DLA moved most against the direct effect (rose; "
             "fell where the direct effect is a gain, as a negative head's is)")


def _explained(section: dict[str, Any]) -> str:
    return (EXPLAINED.format(floor=section.get("repair_floor", 0.0))
            + f"; heads, MLPs, norm and covered by in {section['compensation_unit']}")


def _covered(row: dict[str, Any]) -> str:
    return ", ".join(f"{short_label(entry['layer'], entry['head'])} {entry['value']:+.3f}"
                     for entry in row["compensating"]) or "-"


def _title(section: dict[str, Any]) -> str:
    return (f"Self-repair of {section['model']}: {section['method']} ablation, {section['metric']} "
            f"({section['points']} points; {section['dtype']}; largest |direct| first)")


def _rows(section: dict[str, Any], top: int) -> list[list[str]]:
    """The `top` ablated heads by |direct| effect, in HEADER's columns."""
    return [[short_label(row["layer"], row["head"]), f"{row['total']:+.3f}", f"{row['direct']:+.3f}",
             f"{row['self_repair']:+.3f}", "" if row["repaired"] is None else f"{row['repaired']:.0%}",
             f"{row['by_heads']:+.3f}", f"{row['by_mlps']:+.3f}", f"{row['by_norm']:+.3f}", _covered(row)]
            for row in section["heads"][:top]]


def self_repair_report(section: dict[str, Any], console: Console, *, top: int = TOP) -> None:
    """The `top` ablated heads by |direct| effect, with their self-repair and the heads that cover for them."""
    console.print(Text(_title(section), style="bold"))
    console.print(table(*HEADER, left=("covered by",), rows=_rows(section, top)))
    console.print(Text(f"  {_explained(section)}; {section.get('path', '')}", style="dim"))


def self_repair_grid(section: dict[str, Any]) -> list[list[float | None]]:
    """(n_layers, n_heads) self-repair (None where a head was not ablated), for a layer x head map."""
    return rounded_grid(section, section["heads"], "self_repair")


def self_repair_html(section: dict[str, Any], *, top: int = TOP) -> str:
    """The page's self-repair section: a title, what the columns mean, and the table (every text escaped)."""
    return (f"<h2>{esc(_title(section))}</h2><p class=\"probe-small\">{esc(_explained(section))}.</p>"
            + plain_table(HEADER, _rows(section, top), "probe-self-repair"))

"""How a head is named in every report: one short form (`18.6`, tables, axes, lists) and one long form
(`layer 18, head 6`, hovers, titles and sentences), and one for table columns (`L18H6`, CSV and DataFrames: it never
reads as a number). probe.ablation's labels of heads ablated together (`5.1+18.6`) join short forms. The page script
(assets/probe.js) writes the long form the same way.

An encoder-decoder's payload carries `layer_names` (`enc0`, ..., `dec0`, `x0`, ...: probe.hooks.stacks names them);
its heads read `x3.1` and `layer x3, head 1`. Every function takes those names (None: plain numbers)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_run: dict[str, int] = {}  # how the run computed, where its command line said: `threads`


def computed_on(threads: int) -> None:
    """The threads the run computes on (`probe.threads.use_threads`' choice), said after its precision."""
    _run["threads"] = threads


def _threads_clause() -> str:
    threads = _run.get("threads")
    return "" if threads is None else f", on {threads} thread{'' if threads == 1 else 's'}"


LayerNames = Sequence[str] | None
"""A payload's `layer_names`, or None where it has none (a model of one stack)."""


def layer_label(layer: int, names: LayerNames = None) -> str:
    """`18`, or the layer's name on an encoder-decoder (`x3`)."""
    return str(layer) if not names else names[layer]


def short_label(layer: int, head: int, names: LayerNames = None) -> str:
    """`18.6` (`x3.1`): the form --heads takes."""
    return f"{layer_label(layer, names)}.{head}"


def long_label(layer: int, head: int, names: LayerNames = None) -> str:
    """`layer 18, head 6`: for a reader rather than for a command line."""
    return f"layer {layer_label(layer, names)}, head {head}"


def precision_note(payload: dict[str, Any]) -> str:
    """The footer clause that says what a result was computed in: `computed in bfloat16 (...)`, from the payload's
    `dtype` ("" where it has none: a payload written before results recorded it)."""
    dtype = payload.get("dtype")
    if not dtype:
        return ""
    if dtype == "float32":
        return "computed in float32"
    return f"computed in {dtype}, its sums in float32 or wider (docs/precision.md: how far it lies from float32)"


def precision_sentence(payload: dict[str, Any]) -> str:
    """A terminal report's last line: `Computed in bfloat16, ..., on 2 threads.` ("" for a payload without
    `dtype`)."""
    note = precision_note(payload)
    return f"{note.capitalize()}{_threads_clause()}." if note else ""


def precision_clause(payload: dict[str, Any]) -> str:
    """`; computed in ...`, closing a report's last line of timings ("" for a payload without `dtype`)."""
    note = precision_note(payload)
    return f"; {note}{_threads_clause()}" if note else ""


def precision_fact(payload: dict[str, Any]) -> list[tuple[str, str]]:
    """A page's facts-table row saying what the result was computed in (none for a payload without `dtype`)."""
    note = precision_note(payload)
    return [("precision", note)] if note else []


def column_label(layer: int, head: int, names: LayerNames = None, *, kv: bool = False) -> str:
    """`L18H6` (`x3.1`): a head in a CSV or DataFrame column. pandas reads `0.1` and `0.10` as one float, so a column
    of short labels would merge heads on a model of 10 or more heads per layer; --heads takes this form too. `kv`: a
    key/value head (`L18KV2`), as maps over KV heads name theirs."""
    return f"L{layer}{'KV' if kv else 'H'}{head}" if not names else short_label(layer, head, names)

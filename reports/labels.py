"""How every report names a head: short (`18.6`), long (`layer 18, head 6`, as assets/probe.js writes it) and in a
column (`L18H6`); an encoder-decoder's payload's `layer_names` make them `x3.1` and `layer x3, head 1`."""

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


def number(value: float | None, form: str = ".3f") -> str:
    """A payload number as text; "n/a" where it is None (strict JSON's null)."""
    return "n/a" if value is None else f"{value:{form}}"


def precision_note(payload: dict[str, Any]) -> str:
    """`computed in bfloat16 (...)`, from the payload's `dtype` ("" where a payload predates it)."""
    dtype = payload.get("dtype")
    if not dtype:
        return ""
    if dtype == "float32":
        return "computed in float32"
    return f"computed in {dtype}, its sums in float32 or wider (docs/precision.md: how far it lies from float32)"


def precision_sentence(payload: dict[str, Any]) -> str:
    """A terminal report's last line: `Computed in bfloat16, ..., on 2 threads.`"""
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
    """`L18H6` (`x3.1`; `kv`: `L18KV2`): pandas would read `0.1` and `0.10` as one float and merge two heads."""
    return f"L{layer}{'KV' if kv else 'H'}{head}" if not names else short_label(layer, head, names)

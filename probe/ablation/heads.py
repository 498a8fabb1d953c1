"""Naming heads: (layer, head) pairs, the `5.1,18.6` syntax, range checks, labels, and one list of ablations."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from torch import nn

from probe.hooks.layers import AttentionLayer, attention_layers
from probe.errors import ProbeError
from probe.hooks.stacks import split_layer_part

Head = tuple[int, int]
"""(layer, head)."""
Ablation = tuple[Head, ...]
"""Heads ablated together in one run; a single-head ablation is a 1-tuple."""
T = TypeVar("T")
SYNTAX = {"heads": "use LAYER.HEAD, e.g. 5.1, 5.* or 3-4.0 (encoder-decoders: enc5.1, dec5.1, x5.1)",
          "layers": "use LAYER or FIRST-LAST, e.g. 0-3,10 (encoder-decoders: enc0-2, dec1, x3)"}
"""How heads and layers are written, for the messages about them."""
PLAIN_LABEL = re.compile(r"\b(\d+)\.(\d+)\b")
COLUMN_NAME = re.compile(r"L(\d+)H(\d+)")
"""`column_name`'s form of one head, which --heads takes too."""


def layer_shape(layers: list[AttentionLayer]) -> tuple[int, int]:
    """(layers, most heads of any layer)."""
    return len(layers), max(layer.n_heads for layer in layers)


def _parse_range(text: str, limit: int, what: str, item: str, parameter: str = "heads") -> list[int]:
    text = text.strip()
    malformed = f"malformed {parameter[:-1]} {item!r} in {parameter}"
    if text == "":
        raise ProbeError(f"{malformed}: {SYNTAX[parameter]}", parameter=parameter)
    if text == "*":
        return list(range(limit))
    first, dash, last = text.partition("-")
    try:
        start = int(first)
        stop = int(last) if dash else start
    except ValueError:
        raise ProbeError(f"{malformed}: {SYNTAX[parameter]}", parameter=parameter) from None
    if start > stop:
        raise ProbeError(f"{malformed}: the range {text} runs backwards", parameter=parameter)
    for value in (start, stop):
        if not 0 <= value < limit:
            raise ProbeError(f"{what} {value} in {parameter} {item!r} is out of range: "
                             f"{'the model has' if what == 'layer' else 'the layer has'} {limit} {what}s "
                             f"(0-{limit - 1})", parameter=parameter)
    return list(range(start, stop + 1))


def _layers_named(layer_part: str, layers: list[AttentionLayer], item: str, parameter: str) -> list[AttentionLayer]:
    """The layers `layer_part` names (`3-5`, `x3`, `*`), numbered within their stack on an encoder-decoder."""
    stack, numbers = split_layer_part(layer_part, {layer.stack for layer in layers if layer.stack}, item, parameter)
    in_stack = [layer for layer in layers if layer.stack == stack]  # every layer, on a model of one stack
    return [in_stack[number] for number in _parse_range(numbers, len(in_stack), "layer", item, parameter)]


def _parse_item(item: str, layers: list[AttentionLayer]) -> list[Head]:
    if item.lower() in ("all", "*"):
        return [(layer.index, head) for layer in layers for head in range(layer.n_heads)]
    if item.count(".") > 1:
        raise ProbeError(f"malformed head {item!r} in heads: {SYNTAX['heads']}", parameter="heads")
    named = COLUMN_NAME.fullmatch(item)  # L18H6, a table's column name
    layer_part, dot, head_part = (named[1], ".", named[2]) if named else item.partition(".")
    return [(layer.index, head) for layer in _layers_named(layer_part, layers, item, "heads")
            for head in _parse_range(head_part if dot else "*", layer.n_heads, "head", item)]


def parse_heads(spec: str, layers: list[AttentionLayer]) -> list[Head]:
    """`5.1,18.6` -> [(5, 1), (18, 6)]; also `5.*` or `5` (a whole layer), ranges `3-5.0-2`, and `all` (query heads)."""
    items = [item.strip() for item in spec.split(",")]
    if not spec.strip() or any(not item for item in items):
        raise ProbeError(f"malformed heads {spec!r}: give LAYER.HEAD items separated by commas, e.g. 5.1,18.6",
                         parameter="heads")
    return distinct(head for item in items for head in _parse_item(item, layers))


def parse_layers(spec: str | None, layers: list[AttentionLayer]) -> set[int] | None:
    """`0-3,10` -> {0, 1, 2, 3, 10}; an encoder-decoder's layers by stack, `enc0-2,x3`; None or blank: every layer."""
    if spec is None or not spec.strip():
        return None
    items = [item.strip() for item in spec.split(",")]
    return {layer.index for item in items for layer in _layers_named(item, layers, item, "layers")}


def all_heads(model: nn.Module) -> list[Head]:
    """Every (layer, query head) of the model, in order."""
    return [(layer.index, head) for layer in attention_layers(model) for head in range(layer.n_heads)]


def check_heads(layers: list[AttentionLayer], heads: Iterable[Head]) -> None:
    """ProbeError for a head the model does not have."""
    for layer, head in heads:
        if not 0 <= layer < len(layers):
            raise ProbeError(f"layer {layer} is out of range: the model has {len(layers)} layers "
                             f"(0-{len(layers) - 1})", parameter="heads")
        if not 0 <= head < layers[layer].n_heads:
            raise ProbeError(f"head {layer}.{head} is out of range: layer {layer} has {layers[layer].n_heads} heads "
                             f"(0-{layers[layer].n_heads - 1})", parameter="heads")


def heads_by_layer(ablations: Sequence[Ablation]) -> dict[int, dict[int, list[int]]]:
    """layer -> copy -> its heads (sorted, each once), for stacked copies of a batch."""
    grouped: dict[int, dict[int, set[int]]] = {}
    for copy, ablation in enumerate(ablations):
        for layer, head in ablation:
            grouped.setdefault(layer, {}).setdefault(copy, set()).add(head)
    return {layer: {copy: sorted(heads) for copy, heads in copies.items()} for layer, copies in grouped.items()}


def label(ablation: Sequence[Head], names: Sequence[str] | None = None) -> str:
    """'5.1' or '5.1+18.6'; on an encoder-decoder, with its `layer_names`, 'x1.2+enc0.3'."""
    return "+".join(f"{layer if names is None else names[layer]}.{head}" for layer, head in ablation)


def column_name(ablation: Sequence[Head], names: Sequence[str] | None = None) -> str:
    """'L5H1' or 'L5H1+L18H6': a table column name pandas cannot read as a number; --heads takes both forms."""
    return as_column(label(ablation, names))


def as_column(text: str) -> str:
    """Every plain `5.1` in a label or a list of labels written `L5H1` (as reports/labels.py's `column_label`)."""
    return PLAIN_LABEL.sub(r"L\1H\2", text)


def distinct(items: Iterable[T], key: Callable[[T], object] = lambda item: item) -> list[T]:
    """The items in order, the first of each key kept (ablations, or results keyed by their heads)."""
    seen: dict[object, T] = {}
    for item in items:
        seen.setdefault(key(item), item)
    return list(seen.values())


def ablation_list(model: nn.Module, heads: Sequence[Head] | None, groups: Sequence[Sequence[Head]]) -> list[Ablation]:
    """A sweep's ablations in report order: each head alone (default: all unless `groups`), then each group."""
    layers = attention_layers(model)
    for group in [heads or [], *groups]:
        check_heads(layers, group)
    chosen = list(all_heads(model) if heads is None and not groups else heads or [])
    ablations = distinct([(head,) for head in chosen] + [tuple(group) for group in groups])
    if not ablations:
        raise ProbeError("nothing to ablate: give at least one head", parameter="heads")
    return ablations

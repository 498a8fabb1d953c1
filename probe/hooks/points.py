"""The named hook points of an attention layer: the one registry of what a caller can read or replace. The
installers fire sites (`fire_inputs`, `fire_heads`, `fire_weights`), never named callbacks, so that a new point on an
existing site is one entry in `POINTS`. Per-head tensors are (batch, positions, heads, head_dim), as TransformerLens
lays them out (`k` and `v` with the key/value heads)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import Tensor

from probe.errors import ProbeError
from probe.hooks.types import AttentionInputs, HookContext, InputsHandler, LayerHooks, StatisticsHandler, TensorHandler

if TYPE_CHECKING:
    from probe.kernels.base import FusedStatistics

KINDS = frozenset({"hf", "mha", "custom", "family"})  # every AttentionLayer.kind
SITES = ("inputs", "recompute", "lse", "weights", "heads")
"""Where in a layer's computation a point fires, in this order."""

Writer = Callable[[Tensor, HookContext], Tensor]
"""fn(tensor, ctx) -> the tensor the layer goes on with: the public handler of a writable per-head point."""


def _per_head(field: str) -> Callable[[AttentionInputs, Any, HookContext], AttentionInputs]:
    """An inputs-site point on one field of AttentionInputs (b, h, n, d), handed over as (b, n, h, d)."""
    def apply(inputs: AttentionInputs, handler: TensorHandler, ctx: HookContext) -> AttentionInputs:
        tensor = getattr(inputs, field)
        replaced = handler(tensor.transpose(1, 2), ctx)
        if replaced is None:  # a reader
            return inputs
        if replaced.shape != tensor.transpose(1, 2).shape:
            raise ProbeError(f"a writer of hook point {field[0]!r} returned shape {tuple(replaced.shape)} for "
                             f"layer {ctx.layer}; it must keep {tuple(tensor.transpose(1, 2).shape)}")
        return dataclasses.replace(inputs, **{field: replaced.transpose(1, 2)})  # type: ignore[arg-type]
    return apply


def _whole(inputs: AttentionInputs, handler: InputsHandler, ctx: HookContext) -> AttentionInputs:
    replaced = handler(inputs, ctx)
    return inputs if replaced is None else replaced


@dataclass(frozen=True)
class HookPoint:
    """One named point of an attention layer."""

    name: str
    site: str  # one of SITES
    carries: str  # what the handler gets, with its shape
    writable: bool  # whether a handler's result replaces it
    kinds: frozenset[str]  # layer kinds that fire it
    public: bool = True  # False: probe's own (`Trace` neither reads nor writes it)
    apply: Callable[[AttentionInputs, Any, HookContext], AttentionInputs] | None = None  # inputs-site points
    fallback: bool = False  # a layer kind without it fires `blocked` instead of refusing
    refusal: str = ""  # why the other kinds lack it, for the one-line ProbeError


POINTS: dict[str, HookPoint] = {point.name: point for point in [
    HookPoint("inputs", "inputs", "AttentionInputs: query, key, value (b, heads, positions, head_dim), mask, scaling",
              True, frozenset({"hf"}), public=False, apply=_whole,
              refusal="patching a head's query, key or value inputs works on transformers models whose attention goes "
                      "through the attention interface; this model's attention is its own module: patch the head's "
                      "output"),
    HookPoint("q", "inputs", "queries (batch, positions, query heads, head_dim), after rotary embeddings", True,
              frozenset({"hf", "mha"}), apply=_per_head("query")),
    HookPoint("k", "inputs", "keys (batch, key positions, key/value heads, head_dim), after rotary embeddings", True,
              frozenset({"hf", "mha"}), apply=_per_head("key")),
    HookPoint("v", "inputs", "values (batch, key positions, key/value heads, value head_dim)", True,
              frozenset({"hf", "mha"}), apply=_per_head("value")),
    HookPoint("recompute", "recompute", "the layer's output (batch, positions, query heads, value head_dim), or None "
              "where the handler's `covers_every_head(layer, n_heads)` is true: chosen heads computed again from "
              "ctx.inputs over other keys (window ablation)",
              True, frozenset({"hf"}), public=False,
              refusal="changing which keys a head attends to works on transformers models only; this model's "
                      "attention is its own module"),
    HookPoint("lse", "lse", "the fused kernel's FusedStatistics: queries, keys, bias and log-sum-exp (batch, query "
              "heads, positions) float32", False, frozenset({"hf"}), fallback=True,
              refusal="the log-sum-exp comes from the fused kernel, which only transformers' attention interface runs"),
    HookPoint("blocked", "lse", "why the layer's `lse` could not be had (str): its weights go to `pattern` instead",
              False, KINDS, public=False),
    HookPoint("pattern", "weights", "attention weights (batch, query heads, block, keys) float32, one query block at a "
              "time (ctx.start: the block's first query)", False, KINDS),
    HookPoint("z", "heads", "head outputs before the output projection (batch, positions, query heads, value "
              "head_dim)", True, KINDS),
]}
"""Every hook point by name, in firing order within a site."""


def point_named(name: str, public: bool = False) -> HookPoint:
    """The point of that name (with `public`, only a public one), else a ProbeError naming the public ones."""
    if name not in POINTS or (public and not POINTS[name].public):
        names = ", ".join(point.name for point in POINTS.values() if point.public)
        raise ProbeError(f"no hook point {name!r}; the points are {names}", parameter="points")
    return POINTS[name]


def refusal(point: HookPoint, kind: str, layer: int) -> str:
    """The one-line reason a layer kind cannot serve the point."""
    why = point.refusal or f"{kind} layers do not expose it"
    if not point.public:  # probe's own points: the user asked for a feature, not a point
        return why
    return f"hook point {point.name!r} is not available on layer {layer} ({kind} attention): {why}"


def _at(hooks: LayerHooks, site: str) -> list[tuple[HookPoint, Any]]:
    """(point, handler) of every handler of the layer at `site`, in registry order."""
    return [(point, handler) for point in POINTS.values() if point.site == site for handler in hooks.of(point.name)]


def fire_inputs(hooks: LayerHooks, inputs: AttentionInputs) -> AttentionInputs:
    """The inputs-site points of the layer, in registry order, each on the inputs the previous one left."""
    for point, handler in _at(hooks, "inputs"):
        if point.apply is not None:
            inputs = point.apply(inputs, handler, hooks.context(point.name, inputs=inputs))
    return inputs


def fire_heads(hooks: LayerHooks, heads: Tensor, inputs: AttentionInputs | None = None) -> Tensor:
    """The heads-site points: each handler's result (or the heads, for a reader returning None) goes on."""
    for point, handler in _at(hooks, "heads"):
        replaced = handler(heads, hooks.context(point.name, inputs=inputs))
        if replaced is not None and replaced.shape != heads.shape:
            raise ProbeError(f"a writer of hook point {point.name!r} returned shape {tuple(replaced.shape)} "
                             f"for layer {hooks.layer}; it must keep {tuple(heads.shape)}")
        heads = heads if replaced is None else replaced  # None: a reader
    return heads


def fire_weights(hooks: LayerHooks, start: int, weights: Tensor, inputs: AttentionInputs | None = None) -> None:
    """The weights-site points, read-only: each handler sees one query block, `ctx.start` its first query."""
    for point, handler in _at(hooks, "weights"):
        handler(weights, hooks.context(point.name, start, inputs))


def fire_statistics(hooks: LayerHooks, statistics: FusedStatistics, inputs: AttentionInputs | None = None) -> None:
    """The `lse` point: one layer call's fused statistics, to each of its handlers."""
    ctx = hooks.context("lse", inputs=inputs)
    handler: StatisticsHandler
    for handler in hooks.of("lse"):
        handler(statistics, ctx)


def fires(hooks: LayerHooks, site: str) -> bool:
    """Whether any handler of the layer listens at `site`."""
    return bool(_at(hooks, site))

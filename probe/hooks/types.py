"""What the hook modules share: the handlers (`fn(payload, ctx)`), their context, and what one hooked layer is told."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from probe.kernels.base import FusedStatistics, KernelConfig


@dataclass
class AttentionInputs:
    """What one call of a layer's attention computed its output from (transformers' attention interface)."""

    query: Tensor  # (b, hq, n, d)
    key: Tensor  # (b, hk, kv, d), hq a multiple of hk
    value: Tensor  # (b, hk, kv, d)
    mask: Tensor | None  # broadcastable to (b, hq, n, kv): boolean (True = attend) or additive; None: plain causal
    scaling: float
    softcap: float | None = None
    sinks: Tensor | None = None  # (hq,) learned sink logits (gpt-oss)
    position_bias: Tensor | None = None  # broadcastable to (b, hq, n, kv)


@dataclass(frozen=True)
class BatchContext:
    """The batch a forward runs, as its caller knows it: which batch of a probe set, the set-wide row of each
    sequence, and which positions hold a token. Handed to every handler as `ctx.batch` where the caller passes it
    (`attention_hooks(..., batch=)`), so that an intervention can read other rows or skip padding."""

    index: int | None  # the batch's index in its probe set (None: a forward outside one)
    rows: Tensor  # (batch,) long: each sequence's row in the probe set
    mask: Tensor | None = None  # (batch, positions) bool, True = a token; None: every position is one

    @classmethod
    def of(cls, ids: Tensor, mask: Tensor | None = None, index: int | None = None, first: int = 0) -> BatchContext:
        """The context of a batch of `ids` (batch, positions) whose first sequence is row `first` of its set."""
        return cls(index, torch.arange(first, first + ids.shape[0]), None if mask is None else mask.bool())

    def tokens(self, positions: int) -> Tensor:
        """(batch, positions) bool: True where a sequence holds a token (the mask, or every position without one)."""
        return torch.ones(len(self.rows), positions, dtype=torch.bool) if self.mask is None else self.mask


@dataclass(frozen=True)
class HookContext:
    """Where a handler is called: which layer and point, and what the layer knows there.

    `start` is the first query position the payload holds (a `pattern` block's; 0 elsewhere). `inputs` are the
    queries, keys, values, mask and scaling the layer computes from (after the `inputs`-site writers), where the
    site has them: transformers layers and nn.MultiheadAttention; None at the `z` point of hand-written and family
    layers, whose attention is computed inside the module. `batch` is the caller's BatchContext (rows and padding
    mask), None where the caller gave none."""

    layer: int
    point: str
    start: int = 0
    inputs: AttentionInputs | None = None
    batch: BatchContext | None = None

    @property
    def mask(self) -> Tensor | None:
        """The layer's attention mask as it was given (boolean, True = attend, or additive), or None."""
        return None if self.inputs is None else self.inputs.mask

    @property
    def group(self) -> int | None:
        """Query heads per key/value head (1 without grouped-query attention), or None where inputs are unknown."""
        return None if self.inputs is None else self.inputs.query.shape[1] // self.inputs.key.shape[1]


TensorHandler = Callable[[Tensor, HookContext], Tensor | None]
"""q, k, v, z, pattern, recompute: the tensor the layer goes on with (same shape), or None to leave it (a reader)."""
InputsHandler = Callable[[AttentionInputs, HookContext], AttentionInputs | None]  # `inputs`: the AttentionInputs
StatisticsHandler = Callable[["FusedStatistics", HookContext], None]  # `lse`: one call's fused statistics, read-only
BlockedHandler = Callable[[str, HookContext], None]  # `blocked`: why a layer asked for `lse` runs the blocked path


Handler = TensorHandler | InputsHandler | StatisticsHandler | BlockedHandler
"""`fn(payload, ctx)`, the payload's type set by the point (probe.hooks.points.POINTS)."""


Undo = Callable[[], None]
"""One restoration step; steps are idempotent, so that an interrupted one can be run again."""


@dataclass
class LayerHooks:
    """One hooked layer's handlers by point name, in the order they run, and what its `lse` point runs with."""

    layer: int
    handlers: dict[str, list[Handler]] = field(default_factory=dict)
    query_block: int | None = None
    call: int = 0  # which call of its module this layer is (ALBERT runs one module as every layer)
    calls: int = 1  # how many times the model calls that module per forward
    config: KernelConfig | None = None  # None: probe.kernels.DEFAULT_CONFIG
    batch: BatchContext | None = None  # what the caller knows of the batch, handed on in every HookContext

    def merged(self, inner: LayerHooks) -> LayerHooks:
        """These hooks with a nested `with`'s added after them (same layer, same call)."""
        handlers = {name: [*self.handlers.get(name, ()), *inner.handlers.get(name, ())]
                    for name in {*self.handlers, *inner.handlers}}
        return LayerHooks(self.layer, handlers, inner.query_block or self.query_block, self.call, self.calls,
                          inner.config or self.config, inner.batch or self.batch)

    def context(self, point: str, start: int = 0, inputs: AttentionInputs | None = None) -> HookContext:
        """The HookContext of one call of this layer's `point`."""
        return HookContext(self.layer, point, start, inputs, self.batch)

    def of(self, point: str) -> list[Any]:
        """The handlers of one point, in order; their type is the point's (probe.hooks.points)."""
        return self.handlers.get(point, [])

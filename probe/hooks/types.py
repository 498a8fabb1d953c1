"""What the hook modules share: the callbacks a caller passes, and what one hooked layer is told."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from torch import Tensor

if TYPE_CHECKING:
    from probe.kernels.base import FusedStatistics

WeightsHook = Callable[[int, int, Tensor], None]
"""(layer, first query index of the block, weights (batch, query_heads, block, keys)) -> None."""
HeadsEdit = Callable[[int, Tensor], Tensor]
"""(layer, head outputs (batch, queries, heads, head_dim), before the output projection) -> replacement."""


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


InputsEdit = Callable[[int, "AttentionInputs"], "AttentionInputs"]
"""(layer, the inputs of its attention) -> the inputs it computes from instead (patching queries, keys or values)."""


class HeadsRecompute(Protocol):
    """Heads computed again another way (over other keys: window ablation), from the inputs of the layer's attention."""

    def __call__(self, layer: int, inputs: AttentionInputs, output: Tensor | None) -> Tensor:
        """The layer's output (b, n, hq, d) with the chosen heads recomputed; `output` is the layer's own, or None
        where `covers_every_head` said it is not needed."""

    def covers_every_head(self, layer: int, n_heads: int) -> bool:
        """Whether every head of the layer is recomputed, so that the layer's own attention can be skipped."""


class LseHook(Protocol):
    """Reads a layer's attention from a fused backend's statistics (probe.kernels), where a backend serves the call.
    An optional `config` attribute (a probe.kernels.KernelConfig) is handed to the backend."""

    def __call__(self, layer: int, attention: FusedStatistics) -> None:
        """Called once per layer call with its queries, keys, bias and log-sum-exp."""

    def blocked(self, layer: int, reason: str) -> None:
        """Called instead where the layer's weights cannot be rebuilt from it (they go to `on_weights`), and why."""


Undo = Callable[[], None]
"""One restoration step; steps are idempotent, so that an interrupted one can be run again."""


Handler = Any
"""What a hook point's handler is: a `Writer`-like (layer, tensor) -> tensor for the per-head points, `WeightsHook`
for `pattern`, `LseHook` for `lse`, `HeadsRecompute` for `recompute`, `InputsEdit` for `inputs` (probe.hooks.points)."""


@dataclass
class LayerHooks:
    """What one hooked layer does besides its own computation: the handlers of its hook points, by point name, in
    the order they run (probe.hooks.points fires them)."""

    layer: int
    handlers: dict[str, list[Handler]] = field(default_factory=dict)
    query_block: int | None = None
    call: int = 0  # which call of its module this layer is (ALBERT runs one module as every layer)
    calls: int = 1  # how many times the model calls that module per forward

    def merged(self, inner: LayerHooks) -> LayerHooks:
        """These hooks with a nested `with`'s added after them (same layer, same call)."""
        handlers = {name: [*self.handlers.get(name, ()), *inner.handlers.get(name, ())]
                    for name in {*self.handlers, *inner.handlers}}
        return LayerHooks(self.layer, handlers, inner.query_block or self.query_block, self.call, self.calls)

    @property
    def on_lse(self) -> LseHook | None:
        """The `lse` point's handlers as one LseHook, or None."""
        readers = self.handlers.get("lse")
        return _AllLse(readers) if readers else None

    @property
    def recompute_heads(self) -> HeadsRecompute | None:
        """The `recompute` point's handler (one: two recomputations of the same heads would not compose)."""
        recomputes = self.handlers.get("recompute")
        return recomputes[-1] if recomputes else None


@dataclass
class _AllLse:
    """Several LseHooks as one."""

    readers: list[LseHook]

    def __call__(self, layer: int, attention: FusedStatistics) -> None:
        for reader in self.readers:
            reader(layer, attention)

    def blocked(self, layer: int, reason: str) -> None:
        for reader in self.readers:
            reader.blocked(layer, reason)

    @property
    def config(self) -> Any:
        """The kernel configuration (probe.kernels.KernelConfig) the first reader that names one asks for, or None."""
        configs = (getattr(reader, "config", None) for reader in self.readers)
        return next((config for config in configs if config is not None), None)

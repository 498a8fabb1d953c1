"""What the hook modules share: the callbacks a caller passes, and what one hooked layer is told."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

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


@dataclass
class LayerHooks:
    """What one hooked layer does besides its own computation."""

    layer: int
    on_weights: WeightsHook | None
    edit_heads: HeadsEdit | None
    query_block: int | None
    call: int = 0  # which call of its module this layer is (ALBERT runs one module as every layer)
    calls: int = 1  # how many times the model calls that module per forward
    recompute_heads: HeadsRecompute | None = None  # heads computed over other keys (window ablation); hf layers only
    on_lse: LseHook | None = None  # reads the fused kernel's log-sum-exp where it can (hf layers), else on_weights
    edit_inputs: InputsEdit | None = None  # queries, keys or values replaced before attention; hf layers only

"""What the hook modules share: the callbacks a caller passes, and what one hooked layer is told."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

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


HeadsRecompute = Callable[[int, AttentionInputs, Tensor], Tensor]
"""(layer, the inputs of its attention, its output (b, n, hq, d)) -> the output with some heads computed again
another way (over other keys: window ablation)."""
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

"""What the hook modules share: the callbacks a caller passes, and what one hooked layer is told."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

WeightsHook = Callable[[int, int, Tensor], None]
"""(layer, first query index of the block, weights (batch, query_heads, block, keys)) -> None."""
HeadsEdit = Callable[[int, Tensor], Tensor]
"""(layer, head outputs (batch, queries, heads, head_dim), before the output projection) -> replacement."""
MaskEdit = Callable[[int, Tensor, Tensor, "Tensor | None"], Tensor]
"""(layer, query (b, hq, n, d), key (b, hk, kv, d), the layer's attention mask or None for plain causal) -> the mask
to use instead, in the same format (boolean True = attend, or additive float), broadcastable to (b, hq, n, kv)."""
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
    edit_mask: MaskEdit | None = None  # changes which keys heads may attend to (window ablation); hf layers only

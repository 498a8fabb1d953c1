"""What an HTML page takes besides a kind's payload, typed for the type checker: `Patterns.page_payload()`."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

if sys.version_info >= (3, 11):
    from typing import NotRequired, TypedDict
else:
    from typing_extensions import NotRequired, TypedDict


class PatternsPage(TypedDict):
    """Attention patterns as the heatmap page, the classification page's viewer and the atlas draw them."""

    model: str
    source: str
    tokens: list[str]
    labels: list[str]  # position:token, unique even where tokens repeat
    heads: list[list[int]]  # [layer, head]; head `average` is the layer's mean over its heads
    values: np.ndarray  # (len(heads), n, n) uint16: weight * scale
    decimals: int
    scale: int
    causal: bool
    n_layers: int
    n_heads: int
    total_tokens: int
    note: str
    first: int
    thumbnails: np.ndarray | None  # (len(heads), t, t) uint8: max-pooled weight * 255
    meta: dict[str, Any]  # a probe set's: probe_set, repeat_len, offset
    average: int
    dtype: str
    layer_names: NotRequired[list[str]]

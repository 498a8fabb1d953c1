"""Ablation methods that change which keys a head attends to, rather than what it outputs.

Window ablation restricts the chosen heads to a StreamingLLM cache (Xiao et al. 2023): the first `sink` keys and
the `recent` most recent ones, the softmax renormalised over those alone, exactly what the head computes when its
KV cache keeps nothing else (DuoAttention's streaming heads, Xiao et al. 2024). It works through
`attention_hooks(edit_mask=...)`: the chosen heads' rows of the attention mask lose every other key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from probe.ablation.heads import Ablation
from probe.ablation.methods import METHODS, AblationMethod
from probe.ablation.means import HeadMeans
from probe.errors import ProbeError
from probe.heads.scores import DEFAULT_RECENT, DEFAULT_SINK, window_keys


class PatternAblation(AblationMethod):
    """An ablation that edits the attention pattern of the ablated heads (their keys), not their output."""

    def allowed_keys(self, queries: Tensor, n_keys: int) -> Tensor:
        """(len(queries), n_keys) bool: the keys an ablated head may attend to from each query position."""
        raise NotImplementedError

    def replacement(self, layer: int, heads: Tensor, batch: int | None) -> Tensor:
        return heads  # the output is the head's own, computed over the allowed keys


class WindowAblation(PatternAblation):
    """The head sees only the first `sink` keys and the `recent` most recent ones (its own included)."""

    name = "window"

    def __init__(self, means: HeadMeans | None = None, *, sink: int = DEFAULT_SINK,
                 recent: int = DEFAULT_RECENT) -> None:
        if sink < 0 or recent < 1:
            raise ProbeError(f"a window needs sink >= 0 and recent >= 1 keys, got sink {sink}, recent {recent}",
                             parameter="recent")
        self.sink, self.recent = sink, recent

    def allowed_keys(self, queries: Tensor, n_keys: int) -> Tensor:
        return window_keys(queries, n_keys, self.sink, self.recent)

    def describe(self) -> str | None:
        return f"attention restricted to the first {self.sink} and the {self.recent} most recent keys"

    def add_to_fingerprint(self, digest: "hashlib._Hash") -> None:
        digest.update(f"window {self.sink} {self.recent}".encode())


MaskEditor = Callable[[int, Tensor, Tensor, "Tensor | None"], Tensor]


def mask_editor(ablations: Sequence[Ablation], method: PatternAblation) -> tuple[MaskEditor, set[int]]:
    """An edit_mask function for `len(ablations)` stacked copies of a batch: copy i has the heads of ablations[i]
    restricted to `method.allowed_keys`; and the layers it edits."""
    copies = len(ablations)
    by_layer: dict[int, list[tuple[int, int]]] = {}
    for copy, ablation in enumerate(ablations):
        for layer, head in ablation:
            by_layer.setdefault(layer, []).append((copy, head))
    cache: dict[tuple[int, tuple[int, ...], int, torch.device], Tensor] = {}

    def allowed(layer: int, query: Tensor, n_keys: int) -> Tensor:
        rows, n_heads, n_queries, _ = query.shape
        key = (layer, (rows, n_heads, n_queries), n_keys, query.device)
        if key not in cache:
            queries = torch.arange(n_keys - n_queries, n_keys, device=query.device)  # absolute positions
            causal = torch.arange(n_keys, device=query.device)[None, :] <= queries[:, None]  # (n, kv)
            window = method.allowed_keys(queries, n_keys) & causal
            chosen = torch.zeros(copies, 1, n_heads, 1, 1, dtype=torch.bool, device=query.device)
            for copy, head in by_layer[layer]:
                chosen[copy, 0, head] = True
            both = torch.where(chosen, window, causal)  # (copies, 1, hq, n, kv)
            cache.clear()  # one layer's mask at a time: at long context each is large
            cache[key] = both.expand(copies, rows // copies, *both.shape[2:]).reshape(rows, n_heads, n_queries,
                                                                                     n_keys)
        return cache[key]

    def edit(layer: int, query: Tensor, key: Tensor, mask: Tensor | None) -> Tensor:
        if layer not in by_layer:
            return mask  # type: ignore[return-value]
        keep = allowed(layer, query, key.shape[2])  # (b, hq, n, kv) bool
        if mask is None:
            return keep
        mask = mask[..., :key.shape[2]]
        if mask.dtype == torch.bool:
            return mask & keep
        return torch.where(keep, mask, torch.finfo(mask.dtype).min)

    return edit, set(by_layer)


METHODS.setdefault("window", WindowAblation)

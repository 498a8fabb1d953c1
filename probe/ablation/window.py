"""Ablation methods that change which keys a head attends to, rather than what it outputs.

Window ablation restricts the chosen heads to a StreamingLLM cache (Xiao et al. 2023): the first `sink` keys and
the `recent` most recent ones, the softmax renormalised over those alone, exactly what the head computes when its
KV cache keeps nothing else (DuoAttention's streaming heads, Xiao et al. 2024). It works through
`attention_hooks(recompute_heads=...)`: the chosen heads are computed again over their sink and recent keys alone
(`probe.hooks.restricted`), so a windowed head costs about sink + recent keys per query, not n.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch import Tensor

from probe.ablation.heads import Ablation
from probe.ablation.methods import METHODS, AblationMethod
from probe.ablation.means import HeadMeans
from probe.errors import ProbeError
from probe.heads.scores import DEFAULT_RECENT, DEFAULT_SINK, window_keys
from probe.hooks.restricted import Layout, block_layout, restricted_attention
from probe.hooks.types import AttentionInputs, HeadsRecompute


class PatternAblation(AblationMethod):
    """An ablation that edits the attention pattern of the ablated heads (their keys), not their output."""

    def allowed_keys(self, queries: Tensor, keys: Tensor) -> Tensor:
        """(len(queries), len(keys)) bool: whether an ablated head may attend to each key from each query (absolute
        positions; causality is added on top)."""
        raise NotImplementedError

    def key_spans(self, first: int, stop: int) -> list[tuple[int, int]]:
        """The key ranges queries first .. stop - 1 may attend to: every earlier key unless a method knows better
        (the fewer keys, the less each query block computes)."""
        return [(0, stop)]

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

    def allowed_keys(self, queries: Tensor, keys: Tensor) -> Tensor:
        return window_keys(queries, keys, self.sink, self.recent)

    def key_spans(self, first: int, stop: int) -> list[tuple[int, int]]:
        recent_start = max(self.sink, first - self.recent + 1)  # the first query's oldest recent key
        return [(0, min(self.sink, recent_start)), (recent_start, stop)]

    def describe(self) -> str | None:
        return f"attention restricted to the first {self.sink} and the {self.recent} most recent keys"

    def add_to_fingerprint(self, digest: "hashlib._Hash") -> None:
        digest.update(f"window {self.sink} {self.recent}".encode())


def recompute_editor(ablations: Sequence[Ablation], method: PatternAblation) -> tuple[HeadsRecompute, set[int]]:
    """A recompute_heads function for `len(ablations)` stacked copies of a batch: copy i has the heads of
    ablations[i] computed again over `method`'s keys only (`restricted_attention`); and the layers it edits."""
    copies = len(ablations)
    by_layer: dict[int, dict[int, list[int]]] = {}  # layer -> copy -> heads
    for copy, ablation in enumerate(ablations):
        for layer, head in ablation:
            by_layer.setdefault(layer, {}).setdefault(copy, []).append(head)

    layouts: dict[tuple[int, int, torch.device], Layout] = {}  # one input length at a time: every layer shares it

    def layout(inputs: AttentionInputs) -> Layout:
        key = (inputs.query.shape[2], inputs.key.shape[2], inputs.query.device)
        if key not in layouts:
            layouts.clear()
            layouts[key] = block_layout(*key[:2], method.key_spans, method.allowed_keys, key[2])
        return layouts[key]

    def recompute(layer: int, inputs: AttentionInputs, output: Tensor) -> Tensor:  # output (b, n, hq, d)
        per_copy = output.shape[0] // copies
        output = output.clone()
        for copy, heads in by_layer.get(layer, {}).items():
            rows, chosen = slice(copy * per_copy, (copy + 1) * per_copy), torch.tensor(sorted(set(heads)))
            output[rows, :, chosen] = restricted_attention(inputs, rows, chosen, layout(inputs)).to(output.dtype)
        return output

    return recompute, set(by_layer)


METHODS.setdefault("window", WindowAblation)

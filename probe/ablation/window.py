"""Ablation methods that change which keys a head attends to. Window ablation restricts the chosen heads to a
StreamingLLM cache (Xiao et al. 2023: the first `sink` keys and the `recent` latest, softmax renormalised), through
the `recompute` hook point, so a windowed head costs about sink + recent keys per query."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch import Tensor

from probe.ablation.heads import Ablation, heads_by_layer
from probe.ablation.methods import AblationMethod, register_method
from probe.errors import ProbeError
from probe.heads.scores import DEFAULT_RECENT, DEFAULT_SINK, window_keys
from probe.hooks.restricted import Layout, block_layout, restricted_attention
from probe.hooks.layers import AttentionLayer
from probe.hooks.types import AttentionInputs, Handler, HookContext


class PatternAblation(AblationMethod):
    """An ablation that edits the attention pattern of the ablated heads (their keys), not their output."""

    point = "recompute"

    def allowed_keys(self, queries: Tensor, keys: Tensor) -> Tensor:
        """(len(queries), len(keys)) bool: whether an ablated head may attend to each key from each query."""
        raise NotImplementedError

    def key_spans(self, first: int, stop: int) -> list[tuple[int, int]]:
        """The key ranges queries first .. stop - 1 may attend to (fewer keys, less computed per query block)."""
        return [(0, stop)]

    def replacement(self, heads: Tensor, ctx: HookContext) -> Tensor:
        return heads  # the output is the head's own, computed over the allowed keys

    def handler(self, ablations: Sequence[Ablation]) -> tuple[Handler, set[int]]:
        """The `recompute` handler for the stacked copies (RestrictedHeads), and the layers it recomputes."""
        recompute = RestrictedHeads(ablations, self)
        return recompute, recompute.layers

    def check(self, layers: Sequence[AttentionLayer], edited: set[int]) -> None:
        """A key window is defined on causal self-attention: encoder and cross-attention layers are refused."""
        other = sorted({layers[layer].stack for layer in edited} & {"encoder", "cross"})
        if other:
            raise ProbeError(f"{self.name} ablation restricts a causal head's keys to a decoding cache's; it applies "
                             f"to an encoder-decoder's decoder self-attention (decN.H), not to its "
                             f"{' or '.join(other)} layers", parameter="heads")


@register_method
class WindowAblation(PatternAblation):
    """The head sees only the first `sink` keys and the `recent` most recent ones (its own included)."""

    name = "window"
    summary = (f"restrict the head to the first {DEFAULT_SINK} and the {DEFAULT_RECENT} most recent keys (a "
               "StreamingLLM cache)")

    def __init__(self, *, sink: int = DEFAULT_SINK, recent: int = DEFAULT_RECENT) -> None:
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

    def add_to_fingerprint(self, digest: hashlib._Hash) -> None:
        digest.update(f"window {self.sink} {self.recent}".encode())


class RestrictedHeads:
    """The `recompute` handler for stacked copies: copy i's heads computed again over `method`'s keys only."""

    def __init__(self, ablations: Sequence[Ablation], method: PatternAblation) -> None:
        self.copies, self.method = len(ablations), method
        self.by_layer = heads_by_layer(ablations)  # layer -> copy -> heads
        self._layouts: dict[tuple[int, int, torch.device], Layout] = {}  # one length at a time: all layers share it

    @property
    def layers(self) -> set[int]:
        return set(self.by_layer)

    def covers_every_head(self, layer: int, n_heads: int) -> bool:
        """Whether every copy recomputes every head of the layer: then the layer's own attention is not needed."""
        chosen = self.by_layer.get(layer, {})
        return len(chosen) == self.copies and all(len(heads) == n_heads for heads in chosen.values())

    def _layout(self, inputs: AttentionInputs) -> Layout:
        key = (inputs.query.shape[2], inputs.key.shape[2], inputs.query.device)
        if key not in self._layouts:
            self._layouts.clear()
            self._layouts[key] = block_layout(*key[:2], self.method.key_spans, self.method.allowed_keys, key[2])
        return self._layouts[key]

    def __call__(self, output: Tensor | None, ctx: HookContext) -> Tensor:
        """The layer's output with the chosen heads recomputed from `ctx.inputs`; `output` None where they are all."""
        inputs, layer = ctx.inputs, ctx.layer
        assert inputs is not None  # the recompute site always has them
        batch, n_heads, n_queries, _ = inputs.query.shape
        per_copy = batch // self.copies
        if output is None:  # heads as wide as a value head (multi-head latent attention's are narrower)
            output = inputs.query.new_empty(batch, n_queries, n_heads, inputs.value.shape[-1])
        else:
            output = output.clone()
        for copy, heads in self.by_layer.get(layer, {}).items():
            rows, chosen = slice(copy * per_copy, (copy + 1) * per_copy), torch.tensor(heads)
            output[rows, :, chosen] = restricted_attention(inputs, rows, chosen, self._layout(inputs)).to(output.dtype)
        return output


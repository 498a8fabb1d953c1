"""The public context manager, `attention_hooks`, in the spirit of baukit's nethook: it installs what it needs on
entry and restores the model exactly on exit, also when the body raises or is interrupted; and the streaming
forward that `capture_attention` and the pattern pages are built on."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from probe.hooks.custom import install_custom
from probe.hooks.families import install_family
from probe.hooks.hf import count_calls_per_forward, install_hf, switch_implementation
from probe.hooks.layers import AttentionLayer, attention_layers
from probe.hooks.mha import install_mha
from probe.hooks.restore import restoring
from probe.hooks.run import Source, run_model
from probe.errors import ProbeError
from probe.hooks.types import HeadsEdit, HeadsRecompute, InputsEdit, LayerHooks, LseHook, Undo, WeightsHook

INSTALLERS: dict[str, Callable[[nn.Module, LayerHooks, list[Undo]], None]] = {
    "hf": install_hf, "mha": install_mha, "custom": install_custom,  # type: ignore[dict-item]
    "family": install_family,
}
"""AttentionLayer.kind -> the function that hooks one layer of that kind, appending its undo steps."""


@contextmanager
def attention_hooks(
    model: nn.Module,
    on_weights: WeightsHook | None = None,
    edit_heads: HeadsEdit | None = None,
    layers: set[int] | None = None,
    query_block: int | None = None,
    recompute_heads: HeadsRecompute | None = None,
    on_lse: LseHook | None = None,
    edit_inputs: InputsEdit | None = None,
) -> Iterator[list[AttentionLayer]]:
    """Hook every attention layer (or those in `layers`) for the body of the `with`.

    `on_weights(layer, start, weights)` receives each layer's attention weights, (batch, query_heads, block,
    keys) in float32, in query blocks. `edit_heads(layer, heads)` may replace each layer's head outputs
    (batch, queries, heads, head_dim) before the output projection. `recompute_heads(layer, inputs, output)` may
    compute some heads again from the layer's query, keys and values (over other keys: window ablation; transformers
    models only), before `edit_heads`; `on_weights` sees the layer's own weights. `on_lse(layer, attention)` gets a
    layer's queries, keys and the fused kernel's log-sum-exp instead of its weights (probe.kernels) where they can
    be rebuilt from them (transformers models); elsewhere `on_lse.blocked(layer, reason)` is called and the weights
    go to `on_weights`. `edit_inputs(layer, inputs)` may replace the query, keys and values the layer's attention
    computes from (patching; transformers models only). On exit the model is exactly as before.
    """
    found = attention_layers(model)
    chosen = [layer for layer in found if layers is None or layer.index in layers]
    if recompute_heads is not None and any(layer.kind != "hf" for layer in chosen):
        raise ProbeError("changing which keys a head attends to works on transformers models only; this model's "
                         "attention is its own module")
    if edit_inputs is not None and any(layer.kind != "hf" for layer in chosen):
        raise ProbeError("patching a head's query, key or value inputs works on transformers models whose attention "
                         "goes through the attention interface; this model's attention is its own module: patch the "
                         "head's output")
    with restoring() as undo:
        if any(layer.kind == "hf" for layer in chosen):
            switch_implementation(model, undo)
        if any(layer.calls > 1 for layer in chosen):  # ALBERT: layers are calls of one module
            count_calls_per_forward(model, undo)
        for layer in chosen:
            hooks = LayerHooks(layer.index, on_weights, edit_heads, query_block, layer.call, layer.calls,
                               recompute_heads, on_lse if layer.kind == "hf" else None, edit_inputs)
            if on_lse is not None and layer.kind != "hf":
                on_lse.blocked(layer.index, f"attention computed inside the module ({layer.kind} layer)")
            INSTALLERS[layer.kind](layer.module, hooks, undo)
        yield found


def stream_attention(model: nn.Module, input_ids: Tensor, on_weights: WeightsHook, *,
                     attention_mask: Tensor | None = None, layers: set[int] | None = None,
                     query_block: int | None = None, source: Source | None = None) -> None:
    """One forward that only reads attention: each layer's weights go to `on_weights` one query block at a time.
    `source`: an encoder-decoder's encoder input, (ids, mask or None), where it is not `input_ids` (run_model)."""
    with torch.no_grad(), attention_hooks(model, on_weights=on_weights, layers=layers, query_block=query_block):
        run_model(model, input_ids, attention_mask, logits=False, source=source)


def capture_attention(model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None = None,
                      layers: set[int] | None = None, query_block: int | None = None,
                      source: Source | None = None) -> dict[int, Tensor]:
    """Run one forward and return full attention patterns {layer: (batch, query_heads, q, k)} in float32; an
    encoder-decoder's cross-attention layers have q decoder and k encoder positions (the `source`'s, if given).

    Keeps everything it is asked for: meant for heatmaps and tests, not for scoring long inputs.
    """
    blocks: dict[int, list[Tensor]] = {}

    def keep(layer: int, start: int, weights: Tensor) -> None:
        blocks.setdefault(layer, []).append(weights.detach().cpu())

    stream_attention(model, input_ids, keep, attention_mask=attention_mask, layers=layers, query_block=query_block,
                     source=source)
    return {layer: torch.cat(parts, dim=2) for layer, parts in sorted(blocks.items())}

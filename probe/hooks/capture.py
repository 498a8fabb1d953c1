"""`attention_hooks`, the one context manager that owns every hook (as baukit's nethook), and the streaming forward
that `capture_attention` and the pattern pages are built on."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import cast

import torch
from torch import Tensor, nn

from probe.errors import ProbeError
from probe.hooks.families import install_custom, install_family
from probe.hooks.hf import count_calls_per_forward, install_hf, switch_implementation
from probe.hooks.layers import AttentionLayer, attention_layers
from probe.hooks.mha import install_mha
from probe.hooks.points import POINTS, point_named, refusal
from probe.hooks.restore import restoring
from probe.hooks.run import Source, run_model
from probe.hooks.types import BatchContext, BlockedHandler, Handler, HookContext, LayerHooks, TensorHandler, Undo
from probe.kernels.base import KernelConfig

INSTALLERS: dict[str, Callable[[nn.Module, LayerHooks, list[Undo]], None]] = {  # AttentionLayer.kind -> its installer
    "hf": install_hf, "mha": install_mha, "custom": install_custom, "family": install_family,  # type: ignore[dict-item]
}


@contextmanager
def attention_hooks(model: nn.Module, points: Mapping[str, Handler] | None = None, *, layers: set[int] | None = None,
                    query_block: int | None = None, config: KernelConfig | None = None,
                    batch: BatchContext | None = None) -> Iterator[list[AttentionLayer]]:
    """Hook every attention layer (or those in `layers`) for the body of the `with`: `points` maps a hook point's
    name (probe.hooks.points.POINTS) to its handler, `fn(payload, ctx)`, called with a HookContext.

    `pattern` gets float32 weights (batch, query_heads, block, keys) one query block at a time (`ctx.start`); `lse`
    a fused backend's statistics (run with `config`) where the weights can be rebuilt from them, else `blocked` is
    told why and the weights go to `pattern`. A point a layer kind cannot serve is refused in one line before
    anything changes. Nested `with`s add up, the inner's handlers after the outer's; `batch` reaches every handler
    as `ctx.batch`. On exit the model is exactly as before, also when the body raises or is interrupted.
    """
    handlers = dict(points or {})
    for name in handlers:
        point_named(name)
    found = attention_layers(model)
    chosen = [layer for layer in found if layers is None or layer.index in layers]
    for layer in chosen:  # a point a layer's kind lacks is refused, unless it falls back to `blocked`
        for name in handlers:
            if layer.kind not in POINTS[name].kinds and not POINTS[name].fallback:
                raise ProbeError(refusal(POINTS[name], layer.kind, layer.index))
    per_layer = {layer.index: {name: handler for name, handler in handlers.items() if layer.kind in POINTS[name].kinds}
                 for layer in chosen}
    with restoring() as undo:
        if any(layer.kind == "hf" for layer in chosen):
            switch_implementation(model, undo)
        if any(layer.calls > 1 for layer in chosen):  # ALBERT: layers are calls of one module
            count_calls_per_forward(model, undo)
        for layer in chosen:
            served = {name: [handler] for name, handler in per_layer[layer.index].items()}
            hooks = LayerHooks(layer.index, served, query_block, layer.call, layer.calls, config, batch)
            INSTALLERS[layer.kind](layer.module, hooks, undo)
        for layer in chosen:  # told only once nothing can be refused any more
            fired = per_layer[layer.index]
            if "blocked" in fired and any(POINTS[name].fallback and name not in fired for name in handlers):
                cast(BlockedHandler, fired["blocked"])(f"attention computed inside the module ({layer.kind} layer)",
                                                       HookContext(layer.index, "blocked", batch=batch))
        yield found


def stream_attention(model: nn.Module, input_ids: Tensor, on_weights: TensorHandler, *,
                     attention_mask: Tensor | None = None, layers: set[int] | None = None,
                     query_block: int | None = None, source: Source | None = None) -> None:
    """One forward that only reads attention: each layer's weights go to `on_weights` (a `pattern` handler) one
    query block at a time.
    `source`: an encoder-decoder's encoder input, (ids, mask or None), where it is not `input_ids` (run_model)."""
    with torch.no_grad(), attention_hooks(model, {"pattern": on_weights}, layers=layers,
                                                  query_block=query_block):
        run_model(model, input_ids, attention_mask, logits=False, source=source)


def capture_attention(model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None = None,
                      layers: set[int] | None = None, query_block: int | None = None,
                      source: Source | None = None) -> dict[int, Tensor]:
    """Run one forward and return full attention patterns {layer: (batch, query_heads, q, k)} in float32; an
    encoder-decoder's cross-attention layers have q decoder and k encoder positions (the `source`'s, if given).

    Keeps everything it is asked for: meant for heatmaps and tests, not for scoring long inputs.
    """
    blocks: dict[int, list[Tensor]] = {}

    def keep(weights: Tensor, ctx: HookContext) -> None:
        blocks.setdefault(ctx.layer, []).append(weights.detach().cpu())

    stream_attention(model, input_ids, keep, attention_mask=attention_mask, layers=layers, query_block=query_block,
                     source=source)
    return {layer: torch.cat(parts, dim=2) for layer, parts in sorted(blocks.items())}

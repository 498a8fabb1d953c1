"""Attention restricted to chosen keys, computed over those keys only.

A head restricted to a StreamingLLM cache (the first `sink` keys and the `recent` most recent ones) attends to
sink + recent keys per query, not n: writing the restriction as a dense (heads, n, n) mask would make every query
block pay for all n keys (and keep the fast causal kernels from running), so each query block gathers only the key
ranges its queries may see (`KeySpans`) and runs eager attention (`blocked_attention`) over them, with the exact
per-key restriction (`AllowedKeys`) as its mask. The numbers are those of masked eager attention.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from probe.hooks.blocked import blocked_attention
from probe.hooks.types import AttentionInputs

KeySpans = Callable[[int, int], list[tuple[int, int]]]
"""(first query position, last query position + 1) -> the (start, stop) key ranges those queries may attend to."""
AllowedKeys = Callable[[Tensor, Tensor], Tensor]
"""(query positions (q,), key positions (k,)) -> (q, k) bool: True where the query may attend to the key."""

QUERY_BLOCK = 128  # queries per gathered block: the keys gathered per block are its spans, about sink + recent + 128


def _rows(tensor: Tensor | None, rows: slice, heads: Tensor) -> Tensor | None:
    """A (b | 1, h | 1, ...) tensor's batch rows and heads, where it has them (broadcast dimensions stay)."""
    if tensor is None:
        return None
    if tensor.shape[0] > 1:
        tensor = tensor[rows]
    return tensor[:, heads] if tensor.shape[1] > 1 else tensor


def _block_mask(allowed: Tensor, mask: Tensor | None, start: int, stop: int, index: Tensor) -> Tensor:
    """allowed (q, k) combined with the layer's own mask at the block's rows and the gathered keys."""
    if mask is None:
        return allowed
    block = (mask[..., start:stop, :] if mask.shape[-2] > 1 else mask)[..., index]  # (b, h | 1, q | 1, k)
    if block.dtype == torch.bool:
        return block & allowed
    return block.masked_fill(~allowed, torch.finfo(block.dtype).min)


def _attend(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, inputs: AttentionInputs, sinks: Tensor | None,
            bias: Tensor | None) -> Tensor:
    """One block (b', h', q, d) over its gathered keys: torch's fused kernel where it computes the same function,
    eager attention where the layer soft-caps, biases or adds sink logits."""
    if inputs.softcap is None and sinks is None and bias is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=inputs.scaling)
    return blocked_attention(query, key, value, scaling=inputs.scaling, mask=mask, causal=False, on_block=None,
                             softcap=inputs.softcap, sinks=sinks, position_bias=bias)


def restricted_attention(inputs: AttentionInputs, rows: slice, heads: Tensor, spans: KeySpans,
                         allowed: AllowedKeys) -> Tensor:
    """The output (b', n, len(heads), d) of query heads `heads` of batch rows `rows`, attending only to the keys
    `allowed` lets them see (and the layer's own mask does), causally; queries are the last n key positions."""
    n_queries, n_keys = inputs.query.shape[2], inputs.key.shape[2]
    group = inputs.query.shape[1] // inputs.key.shape[1]
    query = inputs.query[rows][:, heads]  # (b', h', n, d)
    key = inputs.key[rows][:, heads // group]  # (b', h', kv, d): each chosen query head's own KV head
    value = inputs.value[rows][:, heads // group]
    mask = None if inputs.mask is None else _rows(inputs.mask[..., :n_keys], rows, heads)
    bias = _rows(inputs.position_bias, rows, heads)
    sinks = None if inputs.sinks is None else inputs.sinks[heads]
    offset, outputs = n_keys - n_queries, []
    for start in range(0, n_queries, QUERY_BLOCK):
        stop = min(start + QUERY_BLOCK, n_queries)
        positions = torch.arange(start + offset, stop + offset, device=query.device)  # (q,) absolute
        index = torch.cat([torch.arange(first, last, device=query.device)
                           for first, last in spans(start + offset, stop + offset) if last > first])  # (k,)
        keep = allowed(positions, index) & (index[None, :] <= positions[:, None])  # (q, k)
        block_bias = None if bias is None else (bias[..., start:stop, :] if bias.shape[-2] > 1 else bias)[..., index]
        outputs.append(_attend(query[:, :, start:stop], key[:, :, index], value[:, :, index],
                               _block_mask(keep, mask, start, stop, index), inputs, sinks, block_bias))  # (b', h', q, d)
    return torch.cat(outputs, dim=2).transpose(1, 2)  # (b', n, h', d)

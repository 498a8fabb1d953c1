"""Attention restricted to chosen keys (a StreamingLLM cache: sink + recent keys), computed over those keys only: a
dense (heads, n, n) mask would make every query pay for all n keys. Query blocks gather the key ranges they may see
and run in one batched call, the exact restriction as their mask; the numbers are those of masked attention."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from probe.hooks.types import AttentionInputs

KeySpans = Callable[[int, int], list[tuple[int, int]]]
"""(first query position, last query position + 1) -> the (start, stop) key ranges those queries may attend to."""
AllowedKeys = Callable[[Tensor, Tensor], Tensor]
"""(query positions (q,), key positions (k,)) -> (q, k) bool: True where the query may attend to the key."""

QUERY_BLOCK = 128  # queries per block: a window's block gathers about sink + recent + 128 keys
CHUNK_BYTES = 64 * 2**20  # the scores of the blocks computed at once, per batch row and head group


@dataclass(frozen=True)
class Layout:
    """Which keys each query block gathers, for one input length."""

    queries: Tensor  # (blocks, QUERY_BLOCK) query indices into the input's queries; the last block's padding repeats
    keys: Tensor  # (blocks, K) key positions each block gathers (a block needing fewer repeats its key 0, masked)
    additive: Tensor  # (blocks, QUERY_BLOCK, K) float32: 0 where the query may attend to the key, else the minimum


def block_layout(n_queries: int, n_keys: int, spans: KeySpans, allowed: AllowedKeys, device: torch.device) -> Layout:
    """The blocks of `n_queries` queries (the last n_queries of n_keys positions) and the keys each one gathers."""
    offset = n_keys - n_queries
    starts = range(0, n_queries, QUERY_BLOCK)
    gathered = [torch.cat([torch.arange(first, last) for first, last in spans(start + offset, min(
        start + QUERY_BLOCK, n_queries) + offset) if last > first]) for start in starts]
    width = max(len(keys) for keys in gathered)
    keys = torch.zeros(len(gathered), width, dtype=torch.long)
    real = torch.zeros(len(gathered), width, dtype=torch.bool)
    for block, chosen in enumerate(gathered):
        keys[block, :len(chosen)], real[block, :len(chosen)] = chosen, True
    queries = torch.arange(len(gathered) * QUERY_BLOCK).view(len(gathered), QUERY_BLOCK).clamp_(max=n_queries - 1)
    positions = queries + offset  # (blocks, Q) absolute
    keep = torch.stack([allowed(positions[block], keys[block]) for block in range(len(gathered))])  # (blocks, Q, K)
    keep &= real[:, None, :] & (keys[:, None, :] <= positions[:, :, None])
    additive = torch.zeros(keep.shape).masked_fill_(~keep, torch.finfo(torch.float32).min)
    return Layout(queries.to(device), keys.to(device), additive.to(device))


def _select(tensor: Tensor, rows: slice, heads: Tensor) -> Tensor:
    """A (b | 1, h | 1, ...) tensor's batch rows and heads, where it has them (broadcast dimensions stay)."""
    if tensor.shape[0] > 1:
        tensor = tensor[rows]
    return tensor[:, heads] if tensor.shape[1] > 1 else tensor


def _gather(matrix: Tensor, layout: Layout) -> Tensor:
    """(b, h, n | 1, kv) -> (b, h, blocks, Q, K): each block's rows and gathered keys."""
    queries = layout.queries if matrix.shape[-2] > 1 else torch.zeros_like(layout.queries)
    return matrix[:, :, queries[:, :, None], layout.keys[:, None, :]]


def _additive_mask(inputs: AttentionInputs, rows: slice, heads: Tensor, layout: Layout, dtype: torch.dtype) -> Tensor:
    """The layout's restriction and the layer's own mask, as one additive float mask (b' | 1, h' | 1, blocks, Q, K)."""
    lowest = torch.finfo(dtype).min
    additive = layout.additive.to(dtype)[None, None]
    if inputs.mask is None:
        return additive
    own = _gather(_select(inputs.mask[..., :inputs.key.shape[2]], rows, heads), layout)
    if own.dtype == torch.bool:
        return additive.masked_fill(~own, lowest)
    return (additive + own.to(dtype)).clamp_(min=lowest)  # two minima would overflow to -inf: rows of NaN


def _eager(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, inputs: AttentionInputs, bias: Tensor | None,
           sinks: Tensor | None) -> Tensor:
    """Softmax attention written out, for layers that soft-cap logits (Gemma 2), add a bias (T5) or sink logits."""
    scores = (query @ key.transpose(-1, -2)) * inputs.scaling  # (b', h', c, Q, K)
    if inputs.softcap is not None:
        scores = torch.tanh(scores / inputs.softcap) * inputs.softcap
    if bias is not None:
        scores = scores + bias
    scores = scores + mask
    if sinks is not None:  # one more column per head, dropped after the softmax
        column = sinks.reshape(1, -1, 1, 1, 1).expand(*scores.shape[:-1], 1).to(scores.dtype)
        weights = F.softmax(torch.cat([scores, column], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
    else:
        weights = F.softmax(scores, dim=-1, dtype=torch.float32)
    return weights.to(value.dtype) @ value


def restricted_attention(inputs: AttentionInputs, rows: slice, heads: Tensor, layout: Layout) -> Tensor:
    """The output (b', n, len(heads), d) of query heads `heads` of batch rows `rows`, each query attending only to
    the keys the layout allows it (and the layer's own mask does)."""
    n_queries = inputs.query.shape[2]
    kv_heads = heads // (inputs.query.shape[1] // inputs.key.shape[1])  # each query head's own key/value head
    query = inputs.query[rows][:, heads][:, :, layout.queries]  # (b', h', blocks, Q, d)
    key = inputs.key[rows][:, kv_heads][:, :, layout.keys]  # (b', h', blocks, K, d)
    value = inputs.value[rows][:, kv_heads][:, :, layout.keys]
    mask = _additive_mask(inputs, rows, heads, layout, query.dtype)
    bias = None if inputs.position_bias is None else _gather(_select(inputs.position_bias, rows, heads), layout)
    sinks = None if inputs.sinks is None else inputs.sinks[heads]
    plain = inputs.softcap is None and bias is None and sinks is None
    blocks, width = layout.keys.shape
    chunk = max(1, CHUNK_BYTES // (query.shape[0] * len(heads) * QUERY_BLOCK * width * 4))
    outputs = []
    for first in range(0, blocks, chunk):
        part = slice(first, first + chunk)
        if plain:
            outputs.append(F.scaled_dot_product_attention(query[:, :, part], key[:, :, part], value[:, :, part],
                                                          attn_mask=mask[:, :, part], scale=inputs.scaling))
        else:
            outputs.append(_eager(query[:, :, part], key[:, :, part], value[:, :, part], mask[:, :, part], inputs,
                                  None if bias is None else bias[:, :, part], sinks))
    output = torch.cat(outputs, dim=2).flatten(2, 3)[:, :, :n_queries]  # (b', h', n, d)
    return output.transpose(1, 2)

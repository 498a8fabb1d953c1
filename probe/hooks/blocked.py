"""Eager softmax attention one query block at a time, each block's float32 weights handed to a callback, so that
nothing of size heads x n x n is kept. Buffers are reused from block to block (on CPU a fresh 100 MB tensor costs
more in page faults than the softmax that fills it); one the callback keeps is left to it."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor

BLOCK_BYTES = 256 * 2**20  # scores of one query block, per temporary; bounds peak memory at long context
CAUSAL_BLOCK = 128  # smallest query block worth splitting causal attention into

OnBlock = Callable[[int, Tensor], None]
"""(first query index of the block, weights (batch, query_heads, block, keys) in float32) -> None."""

_KEYS_COMPUTED = "probe_keys_computed"  # attribute of a handed-out block: the columns from there on are exactly 0


def keys_computed(weights: Tensor) -> int:
    """How many leading keys of a handed-out block were computed (the rest are exactly 0, for a reduction to skip)."""
    return getattr(weights, _KEYS_COMPUTED, weights.shape[-1])


_use_count = getattr(torch._C, "_storage_Use_Count", None)  # private: without it every block gets fresh memory


def _storage_users(tensor: Tensor) -> int:
    return _use_count(tensor.untyped_storage()._cdata) if _use_count is not None else 1 << 30


class _Buffer:
    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, reusable: bool) -> None:
        self.numel, self.dtype, self.device = numel, dtype, device
        self.reusable = reusable  # False when autograd records: out= arguments do not record gradients
        self.flat: Tensor | None = None
        self.users = 0  # storage users right after allocation: more after a callback means it kept the block
        self.zero_from: tuple[int, int] | None = None  # (rows, first column) of a layout whose later columns are 0

    def view(self, *shape: int) -> Tensor:
        if self.flat is None:
            self.flat = torch.empty(self.numel, dtype=self.dtype, device=self.device)
            self.users = _storage_users(self.flat)
            self.zero_from = None
        return self.flat[:math.prod(shape)].view(*shape)

    def give_up_if_kept(self) -> None:
        """After a callback: if it kept (a view of) the block, the buffer is its own now; take a fresh one next."""
        if self.flat is not None and _storage_users(self.flat) > self.users:
            self.flat = None


def _plan(query: Tensor, key: Tensor, mask: Tensor | None, causal: bool, query_block: int | None
          ) -> tuple[int, int, bool]:
    """(queries per block, keys before the first query (queries are the last n positions of the keys), whether a
    block computes only the keys up to its last query (causal without a mask))."""
    batch, n_heads, n_queries, _ = query.shape
    n_keys = key.shape[2]
    offset = n_keys - n_queries
    truncate = causal and mask is None and offset >= 0  # keys after a block's last query are never attended
    if query_block is not None:
        block = max(1, query_block)
    else:
        block = max(1, min(n_queries, BLOCK_BYTES // max(batch * n_heads * n_keys * 4, 1)))
    if truncate and query_block is None:  # several blocks, so that the skipped keys add up (<= 1/16 computed twice)
        block = min(block, max(CAUSAL_BLOCK, -(-n_queries // 8)))
    return min(block, n_queries), offset, truncate


@lru_cache(maxsize=16)
def _future(size: int, device: torch.device) -> Tensor:
    """The causal mask of a truncated block (True above the diagonal), built once per shape."""
    return torch.ones(size, size, dtype=torch.bool, device=device).triu_(1)


def _apply_mask(scores: Tensor, mask: Tensor, start: int, stop: int, n_keys: int) -> Tensor:
    """scores (b, hq, size, limit) with the block's rows of `mask`: boolean (True = attend) or additive."""
    block_mask = mask[..., start:stop, :n_keys] if mask.shape[-2] > 1 else mask[..., :n_keys]
    if block_mask.dtype == torch.bool:
        return scores.masked_fill_(block_mask.logical_not(), torch.finfo(scores.dtype).min)
    if block_mask.dtype == scores.dtype:
        return scores.add_(block_mask)
    return scores + block_mask


def _block_scores(query: Tensor, key_t: Tensor, start: int, stop: int, limit: int, scaling: float,
                  softcap: float | None, position_bias: Tensor | None, buffer: _Buffer) -> Tensor:
    batch, n_heads, _, head_dim = query.shape
    n_kv_heads, size = key_t.shape[1], stop - start
    rows = n_heads // n_kv_heads * size
    # (b * hk, repeat * size, d): the query heads sharing a key/value head, one after the other
    q = query[:, :, start:stop].reshape(batch * n_kv_heads, rows, head_dim) * scaling
    keys = key_t[..., :limit].reshape(batch * n_kv_heads, head_dim, limit)  # a view: key_t is key transposed
    if buffer.dtype != q.dtype:  # float16: logits in float32, where they cannot overflow (|q . k| past 65504)
        q, keys = q.to(buffer.dtype), keys.to(buffer.dtype)
    out = buffer.view(batch * n_kv_heads, rows, limit) if buffer.reusable else None
    scores = torch.bmm(q, keys, out=out).view(batch, n_heads, size, limit)
    del q
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if position_bias is not None:
        bias = position_bias[..., start:stop, :limit] if position_bias.shape[-2] > 1 else position_bias[..., :limit]
        scores = scores + bias
    return scores  # (b, hq, size, limit)


def _softmax(scores: Tensor, sinks: Tensor | None) -> Tensor:
    """float32 softmax over the keys; learned sink logits (gpt-oss) join as one extra column, dropped after."""
    if sinks is None:
        if scores.dtype == torch.float32 and not scores.requires_grad:
            return torch.softmax(scores, dim=-1, out=scores)
        return F.softmax(scores, dim=-1, dtype=torch.float32)
    batch, _, size, _ = scores.shape
    sink_column = sinks.reshape(1, -1, 1, 1).expand(batch, -1, size, 1).to(scores.dtype)  # (b, hq, size, 1)
    combined = torch.cat([scores, sink_column], dim=-1)
    del scores
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return F.softmax(combined, dim=-1, dtype=torch.float32)[..., :-1]


def _hand_out(on_block: OnBlock, start: int, weights: Tensor, n_keys: int, padded: _Buffer) -> None:
    limit = weights.shape[-1]
    if limit == n_keys:
        on_block(start, weights)
        return
    if padded.reusable:
        batch, n_heads, size, _ = weights.shape
        full = padded.view(batch, n_heads, size, n_keys)  # (b, hq, size, kv)
        full[..., :limit] = weights
        zero_from = padded.zero_from
        if zero_from is None or zero_from[0] != size or zero_from[1] > limit:  # limits grow block by block
            full[..., limit:] = 0
        padded.zero_from = (size, limit)
    else:
        full = F.pad(weights, (0, n_keys - limit))
    setattr(full, _KEYS_COMPUTED, limit)
    on_block(start, full)


def _buffers(query: Tensor, key: Tensor, value: Tensor, block: int) -> tuple[_Buffer, _Buffer]:
    batch, n_heads = query.shape[:2]
    numel = batch * n_heads * block * key.shape[2]
    reusable = not (torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)))
    logits = torch.float32 if query.dtype == torch.float16 else query.dtype  # float16's range ends at 65504
    return (_Buffer(numel, logits, query.device, reusable),
            _Buffer(numel, torch.float32, query.device, reusable))


def blocked_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    scaling: float | None,
    mask: Tensor | None,
    causal: bool,
    on_block: OnBlock | None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    position_bias: Tensor | None = None,
    dropout: float = 0.0,
    query_block: int | None = None,
) -> Tensor:
    """query/key (b, hq, n, d) / (b, hk, kv, d), value (b, hk, kv, dv), hq a multiple of hk; mask broadcastable to
    (b, hq, n, kv), boolean (True = attend) or additive. Returns (b, hq, n, dv); `on_block(start, weights)` sees
    eager attention's float32 weights of each query block over all keys. Without a mask, causal attention computes
    only the keys up to a block's last query (the rest handed out as zeros)."""
    batch, n_heads, n_queries, head_dim = query.shape
    n_kv_heads, n_keys, value_dim = key.shape[1], key.shape[2], value.shape[-1]
    scaling = head_dim**-0.5 if scaling is None else scaling
    block, offset, truncate = _plan(query, key, mask, causal, query_block)
    key_t = key.transpose(-1, -2)  # (b, hk, d, kv)
    scores_buffer, padded = _buffers(query, key, value, block)
    outputs = []
    for start in range(0, n_queries, block):
        stop = min(start + block, n_queries)
        size = stop - start
        limit = stop + offset if truncate else n_keys  # keys this block can attend to
        scores = _block_scores(query, key_t, start, stop, limit, scaling, softcap, position_bias, scores_buffer)
        if mask is not None:
            scores = _apply_mask(scores, mask, start, stop, n_keys)
        elif truncate and n_queries > 1:  # causal: only the last `size` keys can lie after a query
            scores[..., limit - size:].masked_fill_(_future(size, query.device), torch.finfo(scores.dtype).min)
        weights = _softmax(scores, sinks)  # (b, hq, size, limit) float32
        del scores
        if on_block is not None:
            _hand_out(on_block, start, weights, n_keys, padded)
        weights = weights.to(value.dtype)
        if dropout > 0.0:
            weights = F.dropout(weights, p=dropout, training=True)
        # (b, hk, repeat * size, dv) -> (b, hq, size, dv)
        out = torch.matmul(weights.reshape(batch, n_kv_heads, -1, limit), value[:, :, :limit])
        outputs.append(out.view(batch, n_heads, size, value_dim))
        del weights, out
        scores_buffer.give_up_if_kept()  # our own views are gone: any other user is the callback
        padded.give_up_if_kept()
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)

"""Fused attention that also returns each query row's log-sum-exp, and single weights rebuilt from it.

A weight is `A[i, j] = exp(q_i . k_j * scale + bias_ij - lse_i)`: with `lse` from the fused kernel (which computes
it anyway, at the cost of a plain sdpa forward), any diagonal, column or band of A costs O(n x head_dim) per key
offset and head, and no score needs the n x n matrix. The layer's output is the fused kernel's, exact.

`lse_problem` says where a layer's logits cannot be rebuilt exactly this way (soft-capping, learned sinks, dropout,
a device without a wired kernel); the hooks then run the blocked eager path (probe.hooks.blocked) instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

ROWS_BYTES = 64 * 2**20  # logits of rows computed whole (exact row maxima), per chunk
BAND_BLOCK = 256  # query rows per block of a band


def lse_problem(query: Tensor, key: Tensor, mask: Tensor | None, *, causal: bool, softcap: float | None,
                sinks: Tensor | None, dropout: float) -> str:
    """Why this call's weights cannot be rebuilt from a fused kernel's log-sum-exp ("" where they can)."""
    if softcap is not None:
        return "soft-capped logits (the fused kernel has no soft-capping)"
    if sinks is not None:
        return "learned sink logits"
    if dropout > 0.0:
        return "dropout while training"
    if query.device.type != "cpu":
        return f"no log-sum-exp kernel wired for {query.device.type} yet (CPU only; untested without a GPU)"
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad):
        return "gradients requested"
    if causal and mask is None and query.shape[2] != key.shape[2]:
        return "causal queries after a key/value prefix"
    if query.shape[1] % key.shape[1]:
        return "query heads not a multiple of key/value heads"
    return ""


def additive_bias(mask: Tensor | None, position_bias: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """The mask (boolean: True = attend, or additive) and position bias as one additive float tensor, or None."""
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask.logical_not(),
                                                                                   float("-inf"))
    elif mask is not None:
        mask = mask.to(dtype)
    if position_bias is None:
        return mask
    position_bias = position_bias.to(dtype)
    return position_bias if mask is None else mask + position_bias


@dataclass
class FusedAttention:
    """One layer call's queries, keys, additive bias and log-sum-exp: what any weight A[i, j] is rebuilt from."""

    query: Tensor  # (b, hq, n, d)
    key: Tensor  # (b, hk, kv, d)
    bias: Tensor | None  # additive, broadcastable to (b, hq, n, kv); None: plain (causal or not)
    scaling: float
    causal: bool  # keys after the query (j > i + kv - n) get weight 0; only where bias is None
    lse: Tensor  # (b, hq, n) float32

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(batch, query heads, queries, keys)."""
        return self.query.shape[0], self.query.shape[1], self.query.shape[2], self.key.shape[2]

    def _grouped(self, query: Tensor) -> Tensor:
        """(b, hq, m, d) -> (b, hk, rep * m, d): the query heads of one key/value head one after another."""
        b, hq, m, d = query.shape
        return query.reshape(b, self.key.shape[1], (hq // self.key.shape[1]) * m, d)

    def _finish(self, logits: Tensor, rows: Tensor | slice, keys: Tensor, lse: Tensor) -> Tensor:
        """logits (b, hq, m, k) of query rows and keys -> weights: bias added, causal keys zeroed."""
        if self.bias is not None:
            bias = self.bias[..., rows, :] if self.bias.shape[-2] > 1 else self.bias
            logits = logits + bias[..., keys]
        elif self.causal:
            positions = torch.arange(self.shape[2], device=logits.device)[rows] + self.shape[3] - self.shape[2]
            logits = logits.masked_fill(keys[None, :] > positions[:, None], float("-inf"))
        return torch.exp(logits.float() - lse[..., None])

    def diagonal(self, shift: int) -> tuple[int, Tensor]:
        """(first query i, weights (b, hq, m)) of A[i, i + shift] for every query whose key exists."""
        b, hq, n, kv = self.shape
        first, last = max(0, -shift), min(n, kv - shift)
        if last <= first:
            return first, self.lse.new_zeros(b, hq, 0)
        hk, m = self.key.shape[1], last - first
        queries = self.query[:, :, first:last].reshape(b, hk, hq // hk, m, -1)
        keys = self.key[:, :, first + shift:last + shift, None].transpose(2, 3)  # (b, hk, 1, m, d)
        logits = (queries * keys).sum(dim=-1).view(b, hq, m, 1) * self.scaling
        rows = torch.arange(first, last, device=logits.device)
        logits = self._pairs(logits[..., 0], rows, rows + shift)
        return first, torch.exp(logits.float() - self.lse[:, :, first:last])

    def _pairs(self, logits: Tensor, rows: Tensor, keys: Tensor) -> Tensor:
        """logits (b, hq, m) of the pairs (rows[t], keys[t]): bias added, causal keys at -inf."""
        if self.bias is not None:
            bias = self.bias[..., rows, keys] if self.bias.shape[-2] > 1 else self.bias[..., 0, keys]
            return logits + bias
        if self.causal:
            return logits.masked_fill(keys > rows + self.shape[3] - self.shape[2], float("-inf"))
        return logits

    def column(self, key: int) -> Tensor:
        """(b, hq, n): A[i, key] for every query i."""
        b, hq, n, _ = self.shape
        logits = torch.matmul(self._grouped(self.query), self.key[:, :, key:key + 1].transpose(-1, -2))
        logits = logits.view(b, hq, n, 1) * self.scaling
        keys = torch.tensor([key], device=logits.device)
        return self._finish(logits, slice(None), keys, self.lse)[..., 0]

    def band(self, low: int, high: int, first: int = 0) -> Iterator[tuple[int, Tensor, int]]:
        """Query blocks from `first` on: (start, weights (b, hq, block, keys), first key), the weights of keys
        i + low .. i + high of each query i and 0 elsewhere."""
        b, hq, n, kv = self.shape
        for start in range(first, n, BAND_BLOCK):
            stop = min(start + BAND_BLOCK, n)
            key_start, key_stop = max(0, start + low), min(kv, stop - 1 + high + 1)
            if key_stop <= key_start:
                yield start, self.lse.new_zeros(b, hq, stop - start, 0), key_start
                continue
            queries = self._grouped(self.query[:, :, start:stop])
            logits = torch.matmul(queries, self.key[:, :, key_start:key_stop].transpose(-1, -2))
            logits = logits.view(b, hq, stop - start, key_stop - key_start) * self.scaling
            keys = torch.arange(key_start, key_stop, device=logits.device)
            rows = torch.arange(start, stop, device=logits.device)
            outside = (keys[None, :] < rows[:, None] + low) | (keys[None, :] > rows[:, None] + high)
            logits = logits.masked_fill(outside, float("-inf"))
            yield start, self._finish(logits, slice(start, stop), keys, self.lse[:, :, start:stop]), key_start

    def rows(self, rows: Tensor) -> Tensor:
        """(b, hq, len(rows), kv): the query rows' weights over every key, exact (for row maxima)."""
        b, hq, _, kv = self.shape
        keys = torch.arange(kv, device=self.query.device)
        logits = torch.matmul(self._grouped(self.query[:, :, rows]), self.key.transpose(-1, -2))
        logits = logits.view(b, hq, len(rows), kv) * self.scaling
        return self._finish(logits, rows, keys, self.lse[:, :, rows])

    def head_rows(self, batch: int, head: int, rows: Tensor) -> Tensor:
        """(len(rows), kv): one head's weights of the given query rows over every key, in chunks of ROWS_BYTES."""
        kv = self.shape[3]
        group = self.shape[1] // self.key.shape[1]
        keys = torch.arange(kv, device=self.query.device)
        chunk = max(1, ROWS_BYTES // (4 * kv))
        parts = []
        for first in range(0, len(rows), chunk):
            part = rows[first:first + chunk]
            logits = self.query[batch, head, part] @ self.key[batch, head // group].T * self.scaling
            one = FusedAttention(self.query[batch:batch + 1, head:head + 1], self.key[batch:batch + 1, :1],
                                 None if self.bias is None else _head_bias(self.bias, batch, head), self.scaling,
                                 self.causal, self.lse[batch:batch + 1, head:head + 1])
            parts.append(one._finish(logits[None, None], part, keys, one.lse[:, :, part])[0, 0])
        return torch.cat(parts) if parts else self.lse.new_zeros(0, kv)


def _head_bias(bias: Tensor, batch: int, head: int) -> Tensor:
    """The bias of one (sequence, head), kept 4-D."""
    b = batch if bias.shape[0] > 1 else 0
    h = head if bias.shape[1] > 1 else 0
    return bias[b:b + 1, h:h + 1]


def fused_attention(query: Tensor, key: Tensor, value: Tensor, bias: Tensor | None, scaling: float,
                    causal: bool) -> tuple[Tensor, FusedAttention]:
    """The layer's attention output (b, n, hq, d) from the fused CPU kernel, and what its weights are rebuilt from.
    Grouped-query heads go to the kernel as they are (it reads the shared keys per query head). `bias` is additive
    (additive_bias); causal applies only without it."""
    plain_causal = causal and bias is None
    output, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, plain_causal, attn_mask=bias, scale=scaling)
    attention = FusedAttention(query, key, bias, scaling, plain_causal, lse.float())
    return output.transpose(1, 2).contiguous(), attention

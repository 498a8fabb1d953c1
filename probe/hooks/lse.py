"""Fused attention that also returns each query row's log-sum-exp, and single weights rebuilt from it.

A weight is `A[i, j] = exp(q_i . k_j * scale + bias_ij - lse_i)`: with `lse` from the fused kernel (which computes
it anyway, at the cost of a plain sdpa forward), any diagonal, column or band of A costs O(n x head_dim) per key
offset and head, and no score needs the n x n matrix. The layer's output is the fused kernel's, exact.

`lse_problem` says where a layer's logits cannot be rebuilt exactly this way (soft-capping, learned sinks, dropout,
a device without a wired kernel); the hooks then run the blocked eager path (probe.hooks.blocked) instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

ROW_CHUNK = 128  # query rows whose logits are computed whole at once (exact row maxima)
BAND_BLOCK = 64  # query rows per block of a band: each block computes BAND_BLOCK + width - 1 keys
BAND_ROWS = 64 * 2**20 // 4  # logits of a band chunk (batch x heads x rows x keys), in floats


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
    columns: dict[int, Tensor] = field(default_factory=dict, repr=False)  # columns computed so far
    grouped: Tensor | None = field(default=None, repr=False)  # (b, hk, rep, n, d), contiguous, made on first use

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(batch, query heads, queries, keys)."""
        return self.query.shape[0], self.query.shape[1], self.query.shape[2], self.key.shape[2]

    def _grouped(self, query: Tensor) -> Tensor:
        """(b, hq, m, d) -> (b, hk, rep * m, d): the query heads of one key/value head one after another."""
        b, hq, m, d = query.shape
        return query.reshape(b, self.key.shape[1], (hq // self.key.shape[1]) * m, d)

    def _grouped_query(self) -> Tensor:
        """(b, hk, rep, n, d): the queries by key/value head, copied once per layer call (they arrive transposed)."""
        if self.grouped is None:
            b, hq, n, d = self.query.shape
            self.grouped = self.query.reshape(b, self.key.shape[1], hq // self.key.shape[1], n, d).contiguous()
        return self.grouped

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
        if self.bias is None and self.causal and shift > kv - n:  # every key after its query: weight 0
            return first, self.lse.new_zeros(b, hq, last - first)
        hk, m = self.key.shape[1], last - first
        queries = self._grouped_query()[:, :, :, first:last]  # (b, hk, rep, m, d), a view
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
        """(b, hq, n): A[i, key] for every query i (kept: the sink and positional scores both read key 0)."""
        if key not in self.columns:
            self.columns[key] = self._column(key)
        return self.columns[key]

    def _column(self, key: int) -> Tensor:
        b, hq, n, _ = self.shape
        queries = self._grouped_query().view(b, self.key.shape[1], -1, self.query.shape[-1])
        logits = torch.matmul(queries, self.key[:, :, key:key + 1].transpose(-1, -2))
        logits = logits.view(b, hq, n, 1) * self.scaling
        keys = torch.tensor([key], device=logits.device)
        return self._finish(logits, slice(None), keys, self.lse)[..., 0]

    def band(self, low: int, high: int, first: int = 0) -> Iterator[tuple[int, Tensor]]:
        """Chunks of query rows from `first` on: (start, weights (b, hq, rows, high - low + 1)), column c holding
        A[i, i + low + c] (0 where that key does not exist or is masked). One batched matmul per chunk: query blocks
        against the keys their band spans, the band cut out of it by a strided view."""
        width, n = high - low + 1, self.shape[2]
        block = BAND_BLOCK if width > BAND_BLOCK else 16  # keys computed per row: block + width - 1
        rows = max(block, BAND_ROWS // max(self.shape[0] * self.shape[1] * (block + width), 1) // block * block)
        for start in range(first, n, rows):
            stop = min(start + rows, n)
            yield start, self._band_weights(self._band_logits(start, stop, low, width, block), start, stop, low)

    def _band_logits(self, start: int, stop: int, low: int, width: int, block: int) -> Tensor:
        """(b, hq, stop - start, width) scaled logits of the band, through one batched matmul, and the band cut out,
        scaled and put in head order in one pass."""
        b, hq, _, d = self.query.shape
        hk, rep = self.key.shape[1], hq // self.key.shape[1]
        blocks = -(-(stop - start) // block)
        query = F.pad(self.query[:, :, start:stop], (0, 0, 0, blocks * block - (stop - start)))
        query = query.view(b, hk, rep, blocks, block, d).transpose(2, 3).reshape(b, hk, blocks, rep * block, d)
        first_key = start + low  # the first block's first key; keys outside 0 .. kv are zero padding
        span = blocks * block + width - 1
        left, right = max(0, -first_key), max(0, first_key + span - self.key.shape[2])
        keys = F.pad(self.key[:, :, max(0, first_key):first_key + span], (0, 0, left, right))
        windows = keys.unfold(2, block + width - 1, block)  # (b, hk, blocks, d, block + width - 1), a view
        logits = torch.matmul(query, windows)  # (b, hk, blocks, rep * block, block + width - 1)
        s = logits.stride()  # row r of a block: columns r .. r + width - 1 of its window
        band = logits.as_strided((b, hk, blocks, rep, block, width),
                                 (s[0], s[1], s[2], block * s[3], s[3] + s[4], s[4]))
        out = torch.empty(b, hk, rep, blocks, block, width, dtype=torch.float32, device=logits.device)
        torch.mul(band, self.scaling, out=out.transpose(2, 3))
        return out.view(b, hq, blocks * block, width)[:, :, :stop - start]

    def _band_weights(self, logits: Tensor, start: int, stop: int, low: int) -> Tensor:
        """Band logits (float32, ours to change) -> weights: bias gathered, keys that do not exist or are causally
        hidden at weight 0 (masks built only for the chunks that have such keys)."""
        kv, width = self.shape[3], logits.shape[-1]
        keys = torch.arange(start, stop, device=logits.device)[:, None] + low + torch.arange(width, device=logits.device)
        if self.bias is not None:
            bias = self.bias[..., start:stop, :] if self.bias.shape[-2] > 1 else self.bias
            index = keys.clamp(0, kv - 1).expand(*bias.shape[:2], stop - start, width)
            logits += bias.expand(*bias.shape[:2], stop - start, kv).gather(-1, index)
        logits = logits.sub_(self.lse[:, :, start:stop, None]).exp_()
        causal = self.causal and stop - 1 + low + width - 1 > stop - 1 + kv - self.shape[2]
        if start + low < 0 or stop + low + width - 1 > kv or causal:
            hidden = (keys < 0) | (keys >= kv)
            if self.causal:
                hidden |= keys > torch.arange(start, stop, device=keys.device)[:, None] + kv - self.shape[2]
            logits.masked_fill_(hidden, 0.0)
        return logits

    def rows(self, rows: Tensor) -> Tensor:
        """(b, hq, len(rows), kv): the query rows' weights over every key, exact (for row maxima)."""
        b, hq, _, kv = self.shape
        keys = torch.arange(kv, device=self.query.device)
        logits = torch.matmul(self._grouped(self.query[:, :, rows]), self.key.transpose(-1, -2))
        logits = logits.view(b, hq, len(rows), kv) * self.scaling
        return self._finish(logits, rows, keys, self.lse[:, :, rows])

    def argmax_rows(self, batch: int, kv_head: int, heads: Tensor, rows: Tensor) -> Tensor:
        """(len(rows),): the key holding the largest weight (the earliest, on a tie) of each (query head, row) pair
        of one sequence whose heads share key/value head `kv_head`, from the logits (exp is monotonic), in chunks of
        ROW_CHUNK rows, ascending; a plain causal chunk computes only the keys up to its last query."""
        kv, offset = self.shape[3], self.shape[3] - self.shape[2]
        key = self.key[batch, kv_head]  # (kv, d)
        rows, order = rows.sort()
        heads = heads[order]
        tops = []
        for first in range(0, len(rows), ROW_CHUNK):
            part, part_heads = rows[first:first + ROW_CHUNK], heads[first:first + ROW_CHUNK]
            limit = min(kv, int(part[-1]) + offset + 1) if self.causal else kv
            logits = (self.query[batch, part_heads, part] * self.scaling) @ key[:limit].T  # scaled as blocked
            if self.bias is not None:
                bias = self.bias[batch if self.bias.shape[0] > 1 else 0]  # (hq or 1, n or 1, kv)
                logits += bias[part_heads if bias.shape[0] > 1 else 0, part if bias.shape[1] > 1 else 0]
            elif self.causal:  # rows ascending: only keys after the chunk's first query can be hidden
                seen = int(part[0]) + offset + 1
                hidden = torch.arange(seen, limit, device=logits.device)[None, :] > part[:, None] + offset
                logits[:, seen:].masked_fill_(hidden, float("-inf"))
            tops.append(logits.argmax(dim=-1))
        top = torch.cat(tops) if tops else rows.new_zeros(0)
        return torch.empty_like(top).index_copy_(0, order, top)  # back to the order asked for


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

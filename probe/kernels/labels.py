"""The diagonals and columns of one layer call's weights, A[i, i + shift] and A[i, key], rebuilt from the log-sum-exp
in one Triton launch over every query row: the CUDA backend's `tables`.

Each row loads the one key it reads per label where it lies (never gathered into a copy), makes it and the query
float32 (float32 products of the model's own values, docs/precision.md) and writes exp(logit - lse), exactly 0
where the key does not exist or is hidden. With `TRITON_INTERPRET=1` it runs on CPU tensors too.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch
from torch import Tensor

from probe.kernels.base import FusedStatistics, broadcast_bias, interpreted, padded
from probe.kernels.fused import uploaded

triton: Any = None  # imported on first use, as probe.kernels.cuda does: Triton reads TRITON_INTERPRET on import
tl: Any = None

DIAGONAL, COLUMN = 0, 1  # a label's kind, as the kernel reads it


def label_weights(statistics: FusedStatistics, offsets: tuple[int, ...], keys: tuple[int, ...]) -> Tensor:
    """The record's `tables`: (b, hq, n, len(offsets) + len(keys)) float32, A[i, i + offset] for each offset, then
    A[i, key] for each key, in one launch without host synchronisation."""
    query, key, bias, lse = statistics.query, statistics.key, statistics.bias, statistics.lse
    key_mask, window, causal, interpreter = statistics.key_mask, statistics.window, statistics.causal, interpreted()
    b, hq, n, d = query.shape
    hk, kv = key.shape[1], key.shape[2]
    count = len(offsets) + len(keys)
    out = torch.empty(b, hq, n, count, dtype=torch.float32, device=query.device)
    if not count or not n:
        return out
    if bias is not None:
        bias = broadcast_bias(bias, (b, hq, n, kv))
    rows = 32 if interpreter else 64  # the interpreter's cost is per step: small blocks waste nothing there
    _kernel(interpreter)[(-(-n // rows), b * hq)](
        query, key, bias if bias is not None else lse, key_mask if key_mask is not None else lse, lse,
        _labels(offsets, keys, query.device), out,
        *query.stride(), *key.stride(), *(bias.stride() if bias is not None else (0, 0, 0, 0)),
        *(key_mask.stride() if key_mask is not None else (0, 0)),
        n, kv, hq, hq // hk, d, count, statistics.scaling, window or 0, HAS_BIAS=bias is not None,
        HAS_KEY_MASK=key_mask is not None and bias is None, WINDOWED=window is not None and bias is None,
        CAUSAL=causal and bias is None, BLOCK_M=rows, HEAD=padded(d), num_warps=4)
    return out


@functools.lru_cache(maxsize=64)
def _labels(offsets: tuple[int, ...], keys: tuple[int, ...], device: torch.device) -> Tensor:
    """(labels, 2) int32 on `device`: (kind, offset or key) per label; made once per set of labels."""
    rows = [(DIAGONAL, offset) for offset in offsets] + [(COLUMN, key) for key in keys]
    return uploaded(torch.tensor(rows, dtype=torch.int32), device)


@functools.lru_cache(maxsize=2)
def _kernel(interpreter: bool) -> Any:
    """The kernel, compiled by Triton or wrapped by its interpreter (one decoration per mode)."""
    del interpreter  # the cache key
    global triton, tl
    triton, tl = importlib.import_module("triton"), importlib.import_module("triton.language")
    return triton.jit(_label_rows)


def _label_rows(Q, K, B, KeyMask, Lse, Labels, Out, sqb, sqh, sqn, sqd, skb, skh, skn, skd, sbb, sbh, sbn, sbk,
                smb, smk, n, kv, hq, group, d, count, scaling, window, HAS_BIAS: tl.constexpr,
                HAS_KEY_MASK: tl.constexpr, WINDOWED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                HEAD: tl.constexpr):
    """BLOCK_M query rows of one (sequence, query head): each label's weight per row. A row's logit is the float32
    sum of its float32 products (tl.reduce with Triton's combine function: the interpreter serves it however Triton
    was imported)."""
    sequence, head = (tl.program_id(1) // hq).to(tl.int64), tl.program_id(1) % hq
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD)
    present = rows < n
    q = tl.load(Q + sequence * sqb + head * sqh + rows[:, None].to(tl.int64) * sqn + dims[None, :] * sqd,
                mask=present[:, None] & (dims[None, :] < d), other=0.0).to(tl.float32)
    lse = tl.load(Lse + (sequence * hq + head) * n + rows, mask=present, other=0.0)
    k_base = K + sequence * skb + (head // group) * skh  # the key/value head this query head reads
    for label in range(0, count):
        kind, at = tl.load(Labels + 2 * label), tl.load(Labels + 2 * label + 1)
        keys = tl.where(kind == 1, at + rows * 0, rows + at)  # the key each row reads (kind 1: a column)
        exists = present & (keys >= 0) & (keys < kv)
        k = tl.load(k_base + keys[:, None].to(tl.int64) * skn + dims[None, :] * skd,
                    mask=exists[:, None] & (dims[None, :] < d), other=0.0).to(tl.float32)
        logits = tl.reduce(q * k, 1, tl.standard._sum_combine) * scaling
        if HAS_BIAS:
            logits = logits + tl.load(B + sequence * sbb + head * sbh + rows.to(tl.int64) * sbn + keys * sbk,
                                      mask=exists, other=0.0).to(tl.float32)
        hidden = ~exists
        if HAS_KEY_MASK:  # the sequence's own padding: one byte per key, read where the key lies
            hidden = hidden | (tl.load(KeyMask + sequence * smb + keys * smk, mask=exists, other=0) == 0)
        if CAUSAL:
            hidden = hidden | (keys > rows + kv - n)
        if WINDOWED:
            hidden = hidden | (keys <= rows + kv - n - window)
        logits = tl.where(hidden, float("-inf"), logits)
        tl.store(Out + ((sequence * hq + head) * n + rows) * count + label, tl.exp(logits - lse), mask=present)

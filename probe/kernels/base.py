"""What a fused-attention backend provides: read this file to write one.

A backend computes one layer call's attention without the n x n weights: the output, and a `FusedStatistics` record
from which the scores rebuild any weight `A[i, j] = exp(q_i . k_j * scale + bias_ij - lse_i)`. The hooks ask
`backend_for(call)`; where none serves, the layer runs blocked and the result's `path` says why.

A new backend is a class with `name`, `problem` and `run`, one `register_backend(...)` line in
`probe/kernels/__init__.py`, and one entry in `tests/test_backends.py`'s DEVICES (checked against
`probe.kernels.reference` on every case).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary



@dataclass(frozen=True)
class KernelConfig:
    """How the fast path chunks its work. None of them changes a number: a test passes `replace(KernelConfig(), ...)`
    to force a chunking at a short length. Defaults are measured (bench/RESULTS.md); what one backend alone tunes
    lives with it (`SearchConfig`)."""

    # rebuilding weights from the log-sum-exp (probe.kernels.fused.Weights)
    row_chunk: int = 128  # query rows whose logits are computed whole at once (exact row maxima), at least
    rows_at_once: int = 2**21  # logits of the padded rows of every key/value head at once, at most (else one head)
    row_logits: int = 2**20  # logits of whole rows computed at once, at most (row_chunk rows beyond that)
    band_block: int = 64  # query rows per block of a band: each block computes band_block + width - 1 keys
    band_rows: int = 64 * 2**20 // 4  # logits of a band chunk (batch x heads x rows x keys), in floats
    diagonal_rows: int = 4096  # query rows whose diagonals' keys are gathered at once
    gathered_columns: int = 4  # columns computed with the diagonals' gather; more go through one matmul
    gathered_rows: int = 2048  # rows of a gathered band at once (their keys: rows x width x head_dim floats)
    # reading several layer calls as one (probe.accel.accumulate)
    group_bytes: int = 32 * 2**20  # queries and keys of layer calls held back to be read together, at most
    moments: bool = False  # also write each row's moments (probe.kernels.moments, for probe.headvis)


DEFAULT_CONFIG = KernelConfig()
"""The configuration used where none is passed."""


@dataclass(frozen=True)
class AttentionCall:
    """One call of a layer's attention, as the hooks hand it to a backend."""

    query: Tensor  # (b, hq, n, d)
    key: Tensor  # (b, hk, kv, d), hq a multiple of hk (grouped- or multi-query)
    value: Tensor  # (b, hk, kv, dv): dv may differ from d (multi-head latent attention: 128 against 192)
    bias: Tensor | None  # additive, broadcastable to (b, hq, n, kv); None: plain or key_mask / window below.
    # `Backend.problem` is asked before a mask is made additive: it may read the bias' shape, not its values
    scaling: float
    causal: bool  # keys after the query (j > i + kv - n) hidden; only where bias is None
    softcap: float | None = None  # tanh soft-capping of the logits (Gemma 2)
    sinks: Tensor | None = None  # (hq,) learned sink logits (gpt-oss)
    dropout: float = 0.0  # while training
    key_mask: Tensor | None = None  # (b, kv) bool, True: a key the sequence attends; only where bias is None
    window: int | None = None  # causal sliding window: query i sees keys j > i + kv - n - window; bias None

    @property
    def structured(self) -> bool:
        """Whether the mask is given as key_mask / window (scalars and a per-sequence vector), not as a bias."""
        return self.key_mask is not None or self.window is not None

    def dense_bias(self) -> Tensor | None:
        """The call's mask as one additive tensor: `bias`, else key_mask, window and causal made (b or 1, 1, n, kv),
        else None. Made once per key_mask, shape, window and dtype (the layers of one forward share it)."""
        if self.bias is not None or not self.structured:
            return self.bias
        made: dict[tuple, Tensor] = {}
        if self.key_mask is not None:
            made = _DENSE.setdefault(self.key_mask, made)
        form = (self.query.shape[2], self.key.shape[2], self.causal, self.window, self.query.dtype)
        if form not in made:
            made[form] = boolean_as_additive(self.visible(), self.query.dtype)
        return made[form]

    def visible(self) -> Tensor:
        """(b or 1, 1, n, kv) bool: the keys each query sees, from key_mask, causal and window."""
        n, kv, device = self.query.shape[2], self.key.shape[2], self.query.device
        keys = torch.arange(kv, device=device)[None, :]
        last = torch.arange(n, device=device)[:, None] + kv - n  # each query's own position among the keys
        seen = keys <= last if self.causal else torch.ones(n, kv, dtype=torch.bool, device=device)
        if self.window is not None:
            seen = seen & (keys > last - self.window)
        seen = seen[None, None]
        return seen & self.key_mask[:, None, None, :] if self.key_mask is not None else seen

    def with_dense_bias(self) -> AttentionCall:
        """This call with key_mask and window made a dense bias (for kernels that read one); else itself."""
        if not self.structured:
            return self
        return replace(self, bias=self.dense_bias(), causal=False, key_mask=None, window=None)


_DENSE: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
"""key_mask -> {(n, kv, causal, window, dtype): its dense bias}: made once for the layers that share a key_mask."""


@dataclass
class FusedStatistics:
    """What a backend hands the scores for one layer call (probe.kernels.fused.Weights reads it the same way for every
    backend). Row maxima come from `top_keys`, else `search`, else whole rows."""

    backend: str  # the backend that made it (a result's `path` reports it)
    query: Tensor  # (b, hq, n, d): the model's dtype or float32 copies (the same float32 values: docs/precision.md)
    key: Tensor  # (b, hk, kv, d), hq a multiple of hk
    lse: Tensor  # (b, hq, n) float32: each query row's log-sum-exp
    scaling: float
    causal: bool  # keys after the query (j > i + kv - n) weigh 0; with key_mask and window, or plain
    bias: Tensor | None = None  # additive, broadcastable to (b, hq, n, kv); None: plain or key_mask / window
    key_mask: Tensor | None = None  # (b, kv) bool, True: a key the sequence attends (AttentionCall's); bias None
    window: int | None = None  # a causal sliding window (AttentionCall's); bias None
    row_maxima: Tensor | None = field(default=None, repr=False)  # (b, hq, n) float32: each row's largest logit
    top_keys: Tensor | None = field(default=None, repr=False)  # (b, hq, n) int: each row's argmax, from the kernel
    search: RowSearch | None = field(default=None, repr=False)  # answers neighbour_hits where top_keys do not
    tables: LabelTables | None = field(default=None, repr=False)  # a kernel for diagonals and columns (None: gathers)
    config: KernelConfig = DEFAULT_CONFIG  # how the reads chunk their work: never a number
    moments: Tensor | None = field(default=None, repr=False)  # (b, hq, n, 4) where KernelConfig.moments asked

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(batch, query heads, queries, keys)."""
        return self.query.shape[0], self.query.shape[1], self.query.shape[2], self.key.shape[2]

    @property
    def plain(self) -> bool:
        """Whether nothing but causality masks keys: what side_by_side joins."""
        return self.bias is None and self.key_mask is None and self.window is None


class RowSearch(Protocol):
    """A backend's way to tell whether a key holds its row's maximum without the kernel's top keys."""

    def neighbour_hits(self, weights: Any, selected: Tensor, shift: int) -> Tensor:
        """(hq,) float64: per query head, how many selected queries i ((b, n) bool) have their argmax at i + shift,
        read from `weights` (a probe.kernels.fused.Weights, which imports this module)."""

    def reads(self, statistics: FusedStatistics, shifts: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(diagonal offsets, key columns) neighbour_hits reads for these shifts: prefetched in the layer's one pass."""


LabelTables = Callable[["FusedStatistics", tuple[int, ...], tuple[int, ...]], Tensor]
"""(statistics, offsets, keys) -> (b, hq, n, len(offsets) + len(keys)) float32: A[i, i + offset], then A[i, key]."""


class Backend(Protocol):
    """A fused-attention kernel for some calls (a device, dtypes, mask kinds)."""

    name: str  # what a result's `path` reports

    def problem(self, call: AttentionCall) -> str:
        """"" where this backend serves the call, else why not (device, dtype, mask kind, soft-capping, sinks)."""

    def run(self, call: AttentionCall, config: KernelConfig) -> tuple[Tensor, FusedStatistics]:
        """(output (b, n, hq, dv), the call's statistics carrying `config`)."""


BACKENDS: list[Backend] = []
"""The backends the hooks may use, in the order they are asked (probe/kernels/__init__.py registers them)."""


def register_backend(backend: Backend) -> Backend:
    """Add a backend after those registered (a name given twice is refused: results name their backend)."""
    if any(known.name == backend.name for known in BACKENDS):
        raise ValueError(f"a backend named {backend.name!r} is registered already")
    BACKENDS.append(backend)
    return backend


@contextmanager
def using_backend(backend: Backend) -> Iterator[Backend]:
    """Within the block, `backend_for` asks this backend alone (tests and benchmarks compare backends)."""
    saved = BACKENDS[:]
    BACKENDS[:] = [backend]
    try:
        yield backend
    finally:
        BACKENDS[:] = saved


def backend_for(call: AttentionCall) -> tuple[Backend | None, str]:
    """(the first registered backend that serves the call, ""), or (None, why none does)."""
    reasons: dict[str, str] = {}
    for backend in BACKENDS:
        reason = backend.problem(call)
        if not reason:
            return backend, ""
        reasons[backend.name] = reason
    if len(set(reasons.values())) <= 1:
        return None, next(iter(reasons.values()), "no fused-attention backend registered")
    return None, "; ".join(f"{name}: {reason}" for name, reason in reasons.items())


def rebuild_problem(call: AttentionCall) -> str:
    """Why this call's weights cannot be rebuilt from a log-sum-exp on any backend ("" where they can)."""
    query, key = call.query, call.key
    if call.softcap is not None:
        return "soft-capped logits (the fused kernel has no soft-capping)"
    if call.sinks is not None:
        return "learned sink logits"
    if call.dropout > 0.0:
        return "dropout while training"
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad):
        return "gradients requested"
    if call.causal and call.bias is None and query.shape[2] != key.shape[2]:
        return "causal queries after a key/value prefix"
    if call.bias is not None and call.structured:
        return "a bias beside key_mask / window (one mask form per call)"
    if call.window is not None and not call.causal:
        return "a sliding window without causal masking"
    if query.shape[1] % key.shape[1]:
        return "query heads not a multiple of key/value heads"
    return ""


def float32_copy(tensor: Tensor) -> Tensor:
    """A half-precision tensor as float32, wider ones as they are: every rebuilt logit is then a float32 product of the
    model's own values (docs/precision.md)."""
    return tensor.float() if tensor.dtype in (torch.bfloat16, torch.float16) else tensor


def interpreted() -> bool:
    """Whether Triton's interpreter is on (TRITON_INTERPRET=1): kernels then run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_problem(call: AttentionCall, kernel: str) -> str:
    """Why a Triton kernel (float32, bfloat16, float16; heads up to 256) cannot take the call ("" where it can)."""
    dtype = call.query.dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16) or call.key.dtype != dtype or \
            call.value.dtype != dtype:
        return f"queries, keys and values of {dtype} ({kernel} takes float32, bfloat16, float16)"
    if max(call.query.shape[-1], call.value.shape[-1]) > 256:
        return "head size over 256"
    if call.bias is not None and call.bias.dim() > 4:
        return "a bias of more than 4 dimensions"
    return ""


def padded(size: int) -> int:
    """A head size as a Triton kernel holds it: the next power of two, at least 16 (tl.dot's least)."""
    return max(16, 1 << (size - 1).bit_length())


def zero_padded(tensor: Tensor, size: int) -> Tensor:
    """The tensor's last dimension padded by zero columns to `size` (a zero column adds nothing to a logit)."""
    return tensor if tensor.shape[-1] == size else torch.nn.functional.pad(tensor, (0, size - tensor.shape[-1]))


def broadcast_bias(bias: Tensor, shape: tuple[int, int, int, int]) -> Tensor:
    """An additive bias expanded to (b, hq, n, kv): broadcast dimensions get stride 0."""
    return bias[(None,) * (4 - bias.dim())].expand(*shape)


def boolean_as_additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean mask (True = attend) as an additive one: 0 where a key is seen, -inf where not."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask.logical_not(), float("-inf"))


def additive_bias(mask: Tensor | None, position_bias: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """The mask (boolean: True = attend, or additive) and position bias as one additive float tensor, or None."""
    if mask is not None and mask.dtype == torch.bool:
        mask = boolean_as_additive(mask, dtype)
    elif mask is not None:
        mask = mask.to(dtype)
    if position_bias is None:
        return mask
    position_bias = position_bias.to(dtype)
    return position_bias if mask is None else mask + position_bias

"""What a fused-attention backend provides: read this file to write one.

A backend computes one layer call's attention fused, the n x n weights never formed: the output, and a statistics
object from which the scores rebuild any weight `A[i, j] = exp(q_i . k_j * scale + bias_ij - lse_i)` (each query row's
log-sum-exp, with the queries, keys and bias) and ask whether a key holds its row's maximum. The hooks build an
`AttentionCall`, ask `backend_for(call)` which backend serves it, and hand its statistics to the scores; where none
does, the layer runs the blocked eager path and the result's `path` says why. Callers ask a backend (`problem`),
never compare its name.

A new backend (a GPU kernel) is one module with a class that has `name`, `problem` and `run`, whose statistics
are a `FusedStatistics` record (with the kernel's `top_keys` or `row_maxima` where it writes them, and a `search`
where it finds row maxima its own way); one `register_backend(...)` line in `probe/kernels/__init__.py`; and one
entry in `tests/test_backends.py`'s DEVICES (the device its cases run on), which checks it against
`probe.kernels.reference` on every case.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

from probe.kernels.config import DEFAULT_CONFIG, KernelConfig


@dataclass(frozen=True)
class AttentionCall:
    """One call of a layer's attention, as the hooks hand it to a backend."""

    query: Tensor  # (b, hq, n, d)
    key: Tensor  # (b, hk, kv, d), hq a multiple of hk (grouped- or multi-query)
    value: Tensor  # (b, hk, kv, dv): dv may differ from d (multi-head latent attention: 128 against 192)
    bias: Tensor | None  # additive, broadcastable to (b, hq, n, kv) (additive_bias); None: plain, causal or not,
    # or masked by key_mask / window below.
    # `Backend.problem` is asked before a mask is made additive: it may read the bias' presence, shape and device,
    # not its dtype or values
    scaling: float
    causal: bool  # keys after the query (j > i + kv - n) hidden; only where bias is None
    softcap: float | None = None  # tanh soft-capping of the logits (Gemma 2)
    sinks: Tensor | None = None  # (hq,) learned sink logits (gpt-oss)
    dropout: float = 0.0  # while training
    key_mask: Tensor | None = None  # (b, kv) bool, True: a key the sequence attends (padding as a 2-D mask says);
    # only where bias is None: a mask as small as the keys, never n x kv (dense_bias makes the n x kv form)
    window: int | None = None  # a causal sliding window: query i sees keys j with i + kv - n - window < j;
    # only where bias is None

    @property
    def structured(self) -> bool:
        """Whether the mask is given as key_mask / window (scalars and a per-sequence vector), not as a bias."""
        return self.key_mask is not None or self.window is not None

    def dense_bias(self) -> Tensor | None:
        """The call's mask as one additive tensor in the queries' dtype: `bias` where given, else key_mask, window
        and causal made (b or 1, 1, n, kv) with 0 where a key is seen and -inf where not (what `additive_bias`
        makes of the boolean mask they stand for, value for value), else None (plain). Made once per key_mask
        tensor, n, window and dtype (the layers of one forward share it), for backends that read a dense mask."""
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
        """This call with key_mask and window made a dense bias (`dense_bias`; causal then carried by it): for a
        backend whose kernel reads a dense mask. Itself where the mask is a bias already or the call is plain."""
        if not self.structured:
            return self
        return replace(self, bias=self.dense_bias(), causal=False, key_mask=None, window=None)


_DENSE: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
"""key_mask -> {(n, kv, causal, window, dtype): its dense bias}: made once for the layers that share a key_mask."""


@dataclass
class FusedStatistics:
    """What a backend hands the scores for one layer call: a plain record. Every weight A[i, j] = exp(q_i . k_j *
    scale + bias_ij - lse_i) is rebuilt from it (probe.kernels.fused.Weights reads it, the same way for every
    backend), and whether a key holds its row's maximum is read from `top_keys` where the kernel wrote them, else
    asked of `search`, the backend's own way of finding row maxima (the CPU's staged search, FlexAttention's row
    maxima), else computed from whole rows."""

    backend: str  # the backend that made it (a result's `path` reports it)
    query: Tensor  # (b, hq, n, d): in the model's dtype, or float32 copies where the backend keeps them so; a read
    # makes each chunk float32 where it reads it (the same float32 values either way: docs/precision.md)
    key: Tensor  # (b, hk, kv, d), hq a multiple of hk
    lse: Tensor  # (b, hq, n) float32: each query row's log-sum-exp
    scaling: float
    causal: bool  # keys after the query (j > i + kv - n) weigh 0; with key_mask and window, or plain
    bias: Tensor | None = None  # additive, broadcastable to (b, hq, n, kv); None: plain or key_mask / window
    key_mask: Tensor | None = None  # (b, kv) bool, True: a key the sequence attends (AttentionCall's); bias None
    window: int | None = None  # a causal sliding window (AttentionCall's); bias None
    row_maxima: Tensor | None = field(default=None, repr=False)  # (b, hq, n) float32: each row's largest logit
    top_keys: Tensor | None = field(default=None, repr=False)  # (b, hq, n) int: each row's top key (argmax's
    # answer: the earliest maximum, a NaN the largest), where the kernel wrote it
    search: RowSearch | None = field(default=None, repr=False)  # how this backend answers neighbour_hits where
    # top_keys do not, and which diagonals and columns it reads for that (`reads`) (None: whole rows)
    tables: LabelTables | None = field(default=None, repr=False)  # the backend's kernel for the diagonals and
    # columns the scores read (None: gathered keys, one batched matmul per chunk of rows)
    config: KernelConfig = DEFAULT_CONFIG  # how the reads chunk their work: never a number
    moments: Tensor | None = field(default=None, repr=False)  # (b, hq, n, 4) float32 where the config asked for them
    # (KernelConfig.moments): each row's moments, probe.kernels.moments.MOMENTS; None: a reader computes them

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(batch, query heads, queries, keys)."""
        return self.query.shape[0], self.query.shape[1], self.query.shape[2], self.key.shape[2]

    @property
    def plain(self) -> bool:
        """Whether nothing but causality masks keys (no bias, key mask or window): what side_by_side joins."""
        return self.bias is None and self.key_mask is None and self.window is None


class RowSearch(Protocol):
    """A backend's way to tell whether a key holds its row's maximum without the kernel's top keys."""

    def neighbour_hits(self, weights: Any, selected: Tensor, shift: int) -> Tensor:
        """(hq,) float64: per query head, how many selected queries i ((b, n) bool) have their largest weight on
        key i + shift (argmax's answer exactly), read from `weights` (the call's probe.kernels.fused.Weights, which
        imports this module: typed where a search is written)."""

    def reads(self, statistics: FusedStatistics, shifts: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(diagonal offsets, key columns): what neighbour_hits reads of the prefetched table for these shifts on this
        record, declared before it is asked (Weights.neighbour_reads), so that the layer computes them with the
        scores' own diagonals and columns in one pass and none it will not read."""


LabelTables = Callable[["FusedStatistics", tuple[int, ...], tuple[int, ...]], Tensor]
"""(statistics, offsets, keys) -> (b, hq, n, len(offsets) + len(keys)) float32: A[i, i + offset], then A[i, key]; 0
where a key does not exist or is hidden."""


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
    """Within the block, `backend_for` asks this backend alone (tests and benchmarks compare backends on one input:
    calls it refuses go blocked, with its reason); the registry is restored on leaving, also on error."""
    saved = BACKENDS[:]
    BACKENDS[:] = [backend]
    try:
        yield backend
    finally:
        BACKENDS[:] = saved


def backend_for(call: AttentionCall) -> tuple[Backend | None, str]:
    """(the first registered backend that serves the call, ""), or (None, why none does: one reason where every
    backend gives the same, else each backend's)."""
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
    """Why this call's weights cannot be rebuilt from a log-sum-exp on any backend ("" where they can): what every
    backend's `problem` asks first."""
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
    """A half-precision query or key (or a chunk of them) as float32; float32 and wider as they are (no copy). A
    backend whose record keeps whole float32 copies makes them with it (every logit a read rebuilds is then a
    float32 product of the model's own values, so the CPU search's bounds and ties hold as derived for any input
    dtype, docs/precision.md); the reads make each chunk float32 with it, which gives the same values."""
    return tensor.float() if tensor.dtype in (torch.bfloat16, torch.float16) else tensor


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

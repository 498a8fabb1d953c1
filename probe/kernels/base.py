"""What a fused-attention backend provides: read this file to write one.

A backend computes one layer call's attention fused, the n x n weights never formed: the output, and a statistics
object from which the scores rebuild any weight `A[i, j] = exp(q_i . k_j * scale + bias_ij - lse_i)` (each query row's
log-sum-exp, with the queries, keys and bias) and ask whether a key holds its row's maximum. The hooks build an
`AttentionCall`, ask `backend_for(call)` which backend serves it, and hand its statistics to the scores; where none
does, the layer runs the blocked eager path and the result's `path` says why. Callers ask a backend (`problem`),
never compare its name.

A new backend (a GPU kernel) is one module with a class that has `name`, `problem` and `run`, whose statistics
subclass `probe.kernels.fused.FusedAttention` (overriding what its kernel answers faster, such as
`neighbour_hits` from its own row maxima); one `register_backend(...)` line in `probe/kernels/__init__.py`; and one
entry in `tests/test_backends.py`'s DEVICES (the device its cases run on), which checks it against
`probe.kernels.reference` on every case.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

if TYPE_CHECKING:
    from probe.kernels.config import KernelConfig


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


class FusedStatistics(Protocol):
    """What the scores read of a backend's statistics (probe.kernels.fused.FusedAttention is the one implementation
    every backend's object subclasses; the scores type against this)."""

    query: Tensor
    key: Tensor
    bias: Tensor | None
    scaling: float
    causal: bool
    lse: Tensor  # (b, hq, n) float32
    config: KernelConfig
    key_mask: Tensor | None  # (b, kv) bool and a sliding window, where the mask came so (bias None)
    window: int | None

    @property
    def backend(self) -> str:
        """The name of the backend that made it (a result's `path` reports it)."""

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(batch, query heads, queries, keys)."""

    def aligned(self, shift: int) -> Tensor:
        """(b, hq, n): A[i, i + shift], 0 where the key does not exist or is hidden."""

    def column(self, key: int) -> Tensor:
        """(b, hq, n): A[i, key]."""

    def stacked(self, labels: list) -> Tensor:
        """(b, hq, n, len(labels)): diagonals and columns side by side."""

    def covering(self, labels: list) -> tuple[Tensor, list[int]]:
        """A table covering the labels, and each label's column in it."""

    def prefetch(self, shifts: Iterable[int], columns: Iterable[int] = ()) -> None:
        """Compute the diagonals and columns the scores will read, in one pass."""

    def band(self, low: int, high: int, first: int = 0) -> Iterator[tuple[int, Tensor]]:
        """Chunks of rows: (start, A[i, i + low .. i + high])."""

    def rows(self, rows: Tensor) -> Tensor:
        """(b, hq, len(rows), kv): whole rows of weights."""

    def row_tops(self, rows: Tensor) -> Tensor:
        """(b, hq, len(rows)) long: each query row's most-attended key (argmax's answer), on the device."""

    def neighbour_hits(self, selected: Tensor, shift: int) -> Tensor:
        """(hq,) float64: how many selected queries i have their largest weight on key i + shift (argmax's answer)."""


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

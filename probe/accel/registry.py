"""The accelerator registry: for a head class (probe.heads.scores.SCORES) by name, how its sums come from one layer
call's `Weights` instead of its Score's reduce over blocks. An entry gives the same sums and counts as that reduce
(tests/test_accel.py holds every entry to it); a class without one runs blocked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from probe.errors import ProbeError
from probe.heads.scores import SCORES, Batch, selected_sums
from probe.kernels.fused import Label, Weights

Reads = tuple[tuple[int, ...], tuple[int, ...]]
"""(diagonal offsets, key columns) a class reads of a layer call: computed with every other class's in one pass."""


class Accelerator:
    """How a head class's (sums, counts) come from a layer call's fused statistics: by default its selection's mean."""

    layers_at_once: bool = False  # reads several layer calls joined as one (probe.kernels.side_by_side)

    def reads(self, attention: Weights, batch: Batch) -> Reads:
        """The diagonals and columns it reads of this call, computed before it in the layer's one pass."""
        return (), ()

    def selection(self, batch: Batch, n: int, kv: int) -> tuple[Label, Tensor] | None:
        """(the diagonal or column it averages, the (b, n) queries) where it is such a mean; None: its own sums."""
        return None

    def __call__(self, attention: Weights, batch: Batch) -> tuple[Tensor, Tensor]:
        """(sums, counts) of this layer call: its Score's reduce's over all of the call's blocks."""
        chosen = self.selection(batch, attention.shape[2], attention.shape[3])
        assert chosen is not None, "an accelerator without a selection computes its own sums"
        return selected_sums(attention.stacked([chosen[0]])[..., 0], chosen[1].to(attention.lse.device))


def with_key(valid: Tensor, n: int, kv: int, shift: int) -> Tensor:
    """(b, n) bool: the valid queries i of `n` whose key i + shift exists among `kv` and is valid."""
    keys = torch.arange(n, device=valid.device) + shift
    return valid[:, :n] & valid[:, keys.clamp(0, n - 1)] & (keys >= 0) & (keys < kv)


@dataclass(frozen=True)
class Diagonal(Accelerator):
    """The mean of A[i, i + shift] over valid queries i whose key is valid (and in `queries` where given)."""

    shift: Callable[[Batch], int]
    queries: Callable[[Batch], tuple[int, int]] | None = None
    layers_at_once = True  # read with the layer group's other diagonals and columns in one product

    def reads(self, attention: Weights, batch: Batch) -> Reads:
        return (self.shift(batch),), ()

    def selection(self, batch: Batch, n: int, kv: int) -> tuple[Label, Tensor]:
        """The diagonal it averages, and the (b, n) queries it averages over."""
        shift = self.shift(batch)
        selected = with_key(batch.valid, n, kv, shift)
        if self.queries is not None:
            low, high = self.queries(batch)
            queries = torch.arange(n, device=batch.valid.device)
            selected &= (queries >= low) & (queries < high)
        return Label("diagonal", shift), selected


@dataclass(frozen=True)
class Column(Accelerator):
    """The mean of A[i, key] over valid queries i."""

    key: int
    layers_at_once = True

    def reads(self, attention: Weights, batch: Batch) -> Reads:
        return (), (self.key,)

    def selection(self, batch: Batch, n: int, kv: int) -> tuple[Label, Tensor]:
        """The column it averages, and the (b, n) valid queries."""
        return Label("column", self.key), batch.valid[:, :n]


@dataclass(frozen=True)
class FromWeights(Accelerator):
    """Any other class's sums: `compute(attention, batch)`. `neighbour_shifts`: the shifts it asks `neighbour_hits` of
    (their reads are the record's to declare); `layers_at_once`: it also reads layer calls joined as one."""

    compute: Callable[[Weights, Batch], tuple[Tensor, Tensor]]
    neighbour_shifts: tuple[int, ...] = ()
    layers_at_once: bool = False

    def reads(self, attention: Weights, batch: Batch) -> Reads:
        return attention.neighbour_reads(self.neighbour_shifts) if self.neighbour_shifts else ((), ())

    def __call__(self, attention: Weights, batch: Batch) -> tuple[Tensor, Tensor]:
        return self.compute(attention, batch)


ACCELERATORS: dict[str, Accelerator] = {}
"""The head classes with an accelerator, by name (a key of SCORES)."""


def register_accelerator(name: str, accelerator: Accelerator) -> Accelerator:
    """Add the accelerator of the head class `name` (registered first: its Score's reduce is what it must equal)."""
    if name not in SCORES:
        raise ProbeError(f"no head class named {name!r}: register its Score first")
    if name in ACCELERATORS:
        raise ProbeError(f"the head class {name!r} has an accelerator already")
    ACCELERATORS[name] = accelerator
    return accelerator

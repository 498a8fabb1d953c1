"""Ablation methods: what replaces an ablated head's output. One class per method, one signature (as pyvene's
interventions): `replacement(layer, heads, batch)` gives the values that stand in for the ablated heads of `layer`.

- zero ablation: 0 (Michel et al. 2019; Olsson et al. 2022);
- mean ablation: the head's mean output over a reference set (`HeadMeans`), overall or per position;
- resample ablation: the head's output on another sequence of the set (Chan et al. 2022, causal scrubbing; the
  resampling ablation of Wang et al. 2022), each sequence's donor fixed by a seeded derangement.

`batch` is the index of the probe set's batch that is running (None outside a sweep, e.g. in `ablate()`), so that
a method can take values of other sequences of the same batch (resample ablation) with no change to the runners.
"""

from __future__ import annotations

import hashlib
from typing import ClassVar

import torch
from torch import Tensor

from probe.ablation.means import HeadMeans
from probe.errors import ProbeError


class AblationMethod:
    """What an ablated head outputs instead of its own output."""

    name: ClassVar[str]
    per_copy: ClassVar[bool] = False  # the replacement depends on each stacked copy's own values (resample)

    def bind(self, batch_rows: list[int]) -> None:
        """Called by a sweep before it runs, with the number of sequences of each batch of the probe set."""

    def replacement(self, layer: int, heads: Tensor, batch: int | None) -> Tensor:
        """Values broadcastable to `heads` (batch, positions, n_heads, head_dim), one copy of the batch's head
        outputs in `layer`; only the ablated heads' slices are used."""
        raise NotImplementedError

    def describe(self) -> str | None:
        """What the replacement was taken over, for reports (None: nothing to say)."""
        return None

    def add_to_fingerprint(self, digest: "hashlib._Hash") -> None:
        """Feed what the replacement depends on (reference values) to the fingerprint of a results stream, so that a
        resumed sweep can tell two sweeps of this method apart."""


class ZeroAblation(AblationMethod):
    name = "zero"

    def __init__(self, means: HeadMeans | None = None) -> None:
        pass  # zero ablation needs no reference values

    def replacement(self, layer: int, heads: Tensor, batch: int | None) -> Tensor:
        return torch.zeros((), dtype=heads.dtype, device=heads.device)


class MeanAblation(AblationMethod):
    name = "mean"

    def __init__(self, means: HeadMeans | None) -> None:
        if means is None:
            raise ProbeError("mean ablation needs the heads' mean outputs (head_means)", parameter="means")
        self.means = means

    def replacement(self, layer: int, heads: Tensor, batch: int | None) -> Tensor:
        mean = self.means.values[layer]  # (n_heads, head_dim), or per position (positions, n_heads, head_dim)
        if self.means.per_position:
            if mean.shape[0] < heads.shape[1]:
                raise ProbeError(f"per-position means cover {mean.shape[0]} positions, the input has "
                                 f"{heads.shape[1]}: take the means over sequences at least as long")
            mean = mean[: heads.shape[1]]
        return mean.to(device=heads.device, dtype=heads.dtype)

    def describe(self) -> str | None:
        return self.means.describe()

    def add_to_fingerprint(self, digest: "hashlib._Hash") -> None:
        digest.update(str(self.means.per_position).encode())
        for layer in sorted(self.means.values):
            digest.update(self.means.values[layer].cpu().contiguous().numpy().tobytes())


def derangement(rows: int, generator: torch.Generator) -> Tensor:
    """(rows,) donor index of each row, never the row itself: a random permutation read as one cycle (each row
    takes the next one's values), so it is a derangement for any rows >= 2."""
    order = torch.randperm(rows, generator=generator)
    donors = torch.empty(rows, dtype=torch.long)
    donors[order] = order.roll(-1)
    return donors


class ResampleAblation(AblationMethod):
    """Each sequence's head output replaced by the same head's output on another sequence of its batch (at the
    same positions), the donor fixed per batch by a derangement seeded with `seed` and the batch's index."""

    name = "resample"
    per_copy = True

    def __init__(self, means: HeadMeans | None = None, seed: int = 0) -> None:
        self.seed = seed
        self.donors: dict[int | None, Tensor] = {}  # batch index -> (rows,) donor rows in that batch

    def donors_of(self, batch: int | None, rows: int) -> Tensor:
        if rows < 2:
            raise ProbeError("resample ablation takes a head's output from another sequence of the same batch: "
                             "a batch with one sequence has none; use more sequences or another batch_size",
                             parameter="batch_size")
        if batch not in self.donors or len(self.donors[batch]) != rows:
            seed = self.seed * 1_000_003 + (0 if batch is None else batch + 1)
            self.donors[batch] = derangement(rows, torch.Generator().manual_seed(seed))
        return self.donors[batch]

    def bind(self, batch_rows: list[int]) -> None:
        for index, rows in enumerate(batch_rows):
            self.donors_of(index, rows)

    def replacement(self, layer: int, heads: Tensor, batch: int | None) -> Tensor:
        return heads[self.donors_of(batch, heads.shape[0]).to(heads.device)]

    def describe(self) -> str | None:
        """The donors (set-wide row numbers, batch by batch), so that a result says exactly what was swapped."""
        start, batches = 0, []
        for index in sorted(key for key in self.donors if key is not None):
            donors = self.donors[index]
            batches.append(" ".join(str(start + int(d)) for d in donors))
            start += len(donors)
        where = f": donor of each sequence {' | '.join(batches)}" if batches else ""
        return f"resample: another sequence of the batch, seeded derangement (seed {self.seed}){where}"

    def add_to_fingerprint(self, digest: "hashlib._Hash") -> None:
        digest.update(str(self.seed).encode())
        for index in sorted(key for key in self.donors if key is not None):
            digest.update(self.donors[index].numpy().tobytes())


METHODS: dict[str, type[AblationMethod]] = {"zero": ZeroAblation, "mean": MeanAblation,
                                            "resample": ResampleAblation}
"""Ablation methods by name; a new method is one class here."""


def check_method(name: str) -> None:
    if name not in METHODS:
        raise ProbeError(f"unknown ablation method {name!r}: use one of {', '.join(METHODS)}", parameter="method")


def method_named(name: str | AblationMethod, means: HeadMeans | None = None) -> AblationMethod:
    """The method `name` of METHODS, given the reference values it needs; a method object is used as it is."""
    if isinstance(name, AblationMethod):
        return name
    check_method(name)
    return METHODS[name](means)

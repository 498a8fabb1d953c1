"""Ablation methods: what replaces an ablated head's output. One class per method, one signature (as pyvene's
interventions): `replacement(layer, heads, batch)` gives the values that stand in for the ablated heads of `layer`.

- zero ablation: 0 (Michel et al. 2019; Olsson et al. 2022);
- mean ablation: the head's mean output over a reference set (`HeadMeans`), overall or per position.

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


METHODS: dict[str, type[AblationMethod]] = {"zero": ZeroAblation, "mean": MeanAblation}
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

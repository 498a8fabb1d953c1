"""Reducing attention into scores one block at a time, so that full patterns are never kept."""

from __future__ import annotations

import torch
from torch import Tensor

from probe.heads.scores import SCORES, Batch


class ScoreAccumulator:
    """Running sums and counts of several scores for every (layer, head), fed one block of weights at a time."""

    def __init__(self, names: list[str], n_layers: int, n_heads: int) -> None:
        self.names = names
        self.sums: dict[str, Tensor] = {}
        self.counts: dict[str, Tensor] = {}
        self.shape = (n_layers, n_heads)
        self.batch: Batch | None = None

    def update(self, layer: int, start: int, weights: Tensor) -> None:
        """Add one block of weights (batch, heads, block, keys) of `layer`, its first query at `start`."""
        if self.batch is None:
            raise RuntimeError("set ScoreAccumulator.batch before the forward pass")
        for name in self.names:
            sums, counts = SCORES[name].reduce(weights, start, self.batch)
            if name not in self.sums:
                self.sums[name] = torch.zeros(*self.shape[:1], *sums.shape, dtype=torch.float64)
                self.counts[name] = torch.zeros_like(self.sums[name])
            self.sums[name][layer] += sums.cpu()
            self.counts[name][layer] += counts.cpu()

    def result(self) -> dict[str, Tensor]:
        """{name: (n_layers, n_heads) float64}, each score finished by its own `finish`."""
        return {name: SCORES[name].finish(self.sums[name], self.counts[name]) for name in self.names}

"""Reducing attention into scores one block at a time, so that full patterns are never kept: every class by its
Score's reduce. probe.accel.FusedAccumulator reads fused statistics into the same running sums."""

from __future__ import annotations

import torch
from torch import Tensor

from probe.heads.scores import SCORES, Batch

BLOCKED = "blocked"


def _zeros(shape: tuple[int, ...], part: Tensor) -> Tensor:
    """Running float64 sums for parts like `part`: on a CUDA part's device (no host round-trip per layer)."""
    return torch.zeros(shape, dtype=torch.float64, device=part.device if part.device.type == "cuda" else "cpu")


def _add_at(total: Tensor, layers: list[int], part: Tensor, dim: int = 0) -> None:
    """total[layers] += part along `dim`, by a slice or per layer (no index tensor sent to the device)."""
    part = part.to(total.device)
    if layers == list(range(layers[0], layers[-1] + 1)):
        total.narrow(dim, layers[0], len(layers)).add_(part)
        return
    for index, layer in enumerate(layers):
        total.select(dim, layer).add_(part.select(dim, index) if part.shape[dim] > 1 else part.select(dim, 0))


class ScoreAccumulator:
    """Running sums and counts of several scores for every (layer, head), fed one block of weights at a time."""

    def __init__(self, names: list[str], n_layers: int, n_heads: int) -> None:
        self.names = names
        self.sums: dict[str, Tensor] = {}
        self.counts: dict[str, Tensor] = {}
        self.shape = (n_layers, n_heads)
        self._current: Batch | None = None
        self.stacks: dict[tuple[str, ...], tuple[Tensor, Tensor]] = {}  # running sums and counts of scores added
        # together (`add_stacked`), (scores, n_layers, h) each: the rows of `sums` and `counts` of its scores

    @property
    def batch(self) -> Batch | None:
        """The batch the coming blocks belong to (setting it first reads what is held back for the last one)."""
        return self._current

    @batch.setter
    def batch(self, batch: Batch | None) -> None:
        self.flush()
        self._current = batch

    def flush(self) -> None:
        """Read what is held back: nothing here (probe.accel.FusedAccumulator holds layer calls back)."""

    def add(self, name: str, layers: list[int], sums: Tensor, counts: Tensor) -> None:
        """Add sums and counts (len(layers), ...) of `layers`."""
        if name not in self.sums:
            self.sums[name], self.counts[name] = (_zeros((self.shape[0], *part.shape[1:]), part)
                                                  for part in (sums, counts))
        _add_at(self.sums[name], layers, sums)
        _add_at(self.counts[name], layers, counts)

    def add_stacked(self, names: list[str], layers: list[int], sums: Tensor, counts: Tensor) -> None:
        """Add the scores' sums (scores, len(layers), h) and counts (scores,) of `layers` in one addition each: their
        running sums are one stacked tensor (each score's `sums[name]` a view of its row), made on the first call;
        where a score's sums exist apart already (a layer added on its own first), each is added on its own."""
        stacked = self.stacks.get(tuple(names))
        if stacked is None and not any(name in self.sums for name in names):
            shape = (len(names), self.shape[0], sums.shape[-1])
            stacked = self.stacks[tuple(names)] = (_zeros(shape, sums), _zeros(shape, sums))
            for index, name in enumerate(names):
                self.sums[name], self.counts[name] = stacked[0][index], stacked[1][index]
        if stacked is None:
            for index, name in enumerate(names):
                self.add(name, layers, sums[index], counts[index, None, None].expand_as(sums[index]))
            return
        _add_at(stacked[0], layers, sums, dim=1)
        _add_at(stacked[1], layers, counts[:, None, None], dim=1)

    def _batch(self) -> Batch:
        if self.batch is None:
            raise RuntimeError("set ScoreAccumulator.batch before the forward pass")
        return self.batch

    def update(self, layer: int, start: int, weights: Tensor) -> None:
        """Add one block of weights (batch, heads, block, keys) of `layer`, its first query at `start`."""
        batch = self._batch()
        for name in self.names:
            sums, counts = SCORES[name].reduce(weights, start, batch)
            self.add(name, [layer], sums[None], counts[None])

    def path(self) -> str:
        """Which way the scores were computed: "blocked" (every layer, weights)."""
        return BLOCKED

    def result(self) -> dict[str, Tensor]:
        """{name: (n_layers, n_heads) float64}, each score finished by its own `finish`."""
        self.flush()
        return {name: SCORES[name].finish(self.sums[name].cpu(), self.counts[name].cpu()) for name in self.names}

"""Reducing attention into scores one block at a time, so that full patterns are never kept; or, on the fast path,
from each layer's log-sum-exp (probe.hooks.lse), so that the weights are never formed at all."""

from __future__ import annotations

import torch
from torch import Tensor

from probe.heads.scores import SCORES, Batch
from probe.hooks.lse import FusedAttention

LSE = "lse"


class ScoreAccumulator:
    """Running sums and counts of several scores for every (layer, head), fed one block of weights at a time
    (`update`) or one layer call's log-sum-exp (`__call__`, an LseHook for attention_hooks)."""

    def __init__(self, names: list[str], n_layers: int, n_heads: int) -> None:
        self.names = names
        self.sums: dict[str, Tensor] = {}
        self.counts: dict[str, Tensor] = {}
        self.shape = (n_layers, n_heads)
        self.batch: Batch | None = None
        self.paths: dict[int, str] = {}  # layer -> LSE, or why its weights went the blocked way

    @property
    def fast(self) -> bool:
        """Whether every score has a fast path (otherwise every layer runs the blocked path)."""
        return all(SCORES[name].fast is not None for name in self.names)

    def _add(self, name: str, layer: int, sums: Tensor, counts: Tensor) -> None:
        if name not in self.sums:
            self.sums[name] = torch.zeros(*self.shape[:1], *sums.shape, dtype=torch.float64)
            self.counts[name] = torch.zeros_like(self.sums[name])
        self.sums[name][layer] += sums.cpu()
        self.counts[name][layer] += counts.cpu()

    def _batch(self) -> Batch:
        if self.batch is None:
            raise RuntimeError("set ScoreAccumulator.batch before the forward pass")
        return self.batch

    def update(self, layer: int, start: int, weights: Tensor) -> None:
        """Add one block of weights (batch, heads, block, keys) of `layer`, its first query at `start`."""
        batch = self._batch()
        for name in self.names:
            self._add(name, layer, *SCORES[name].reduce(weights, start, batch))

    def __call__(self, layer: int, attention: FusedAttention) -> None:
        """Add one layer call from its queries, keys and log-sum-exp (each score's `fast`; the diagonals the scores
        read computed first, in one pass)."""
        batch = self._batch()
        attention.prefetch([shift for name in self.names for shift in SCORES[name].diagonals(batch)],
                           [key for name in self.names for key in SCORES[name].columns(batch)])
        for name in self.names:
            fast = SCORES[name].fast
            assert fast is not None, name
            self._add(name, layer, *fast(attention, batch))
        self.paths.setdefault(layer, LSE)

    def blocked(self, layer: int, reason: str) -> None:
        """The layer's weights go to `update` instead, for `reason`."""
        self.paths[layer] = reason

    def path(self) -> str:
        """Which way the scores were computed: "lse", "blocked" (every layer), or "lse; blocked at layers ...:
        reason" for the layers whose logits the fused kernel cannot rebuild."""
        if not self.paths:
            return "blocked"
        reasons: dict[str, list[int]] = {}
        for layer, reason in sorted(self.paths.items()):
            if reason != LSE:
                reasons.setdefault(reason, []).append(layer)
        if not reasons:
            return LSE
        parts = "; ".join(f"blocked at layers {', '.join(map(str, layers))}: {reason}"
                          for reason, layers in reasons.items())
        return parts if len(reasons) == 1 and sum(map(len, reasons.values())) == len(self.paths) else f"{LSE}; {parts}"

    def result(self) -> dict[str, Tensor]:
        """{name: (n_layers, n_heads) float64}, each score finished by its own `finish`."""
        return {name: SCORES[name].finish(self.sums[name], self.counts[name]) for name in self.names}

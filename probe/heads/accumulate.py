"""Reducing attention into scores one block at a time, so that full patterns are never kept; or, on the fast path,
from each layer's log-sum-exp (probe.hooks.lse), so that the weights are never formed at all."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from probe.heads.scores import SCORES, Batch
from probe.hooks.lse import FusedAttention, Label

LSE = "lse"


@dataclass(frozen=True)
class LinearPlan:
    """The scores that are the mean of one diagonal or column over selected queries (Diagonal, Column), for one
    batch: every layer reads them in one product of its table of those weights with their selections, instead of a
    dozen small operations per score and layer."""

    names: list[str]
    labels: list[Label]  # the diagonal or column each score reads
    selected: Tensor  # (b, n, len(names)) float: 1 where query i counts for score s
    counts: Tensor  # (len(names),) float64: the queries each score counts

    def selection(self, columns: list[int], width: int) -> Tensor:
        """(b, n, width, len(names)): each score's selection on its label's column of a table `width` wide."""
        b, n, count = self.selected.shape
        out = self.selected.new_zeros(b, n, width, count)
        for index, column in enumerate(columns):
            out[:, :, column, index] = self.selected[..., index]
        return out


def linear_plan(names: list[str], batch: Batch, n: int, kv: int) -> LinearPlan:
    """The LinearPlan of the scores `names` that have a selection (the others compute their own sums)."""
    chosen = {name: SCORES[name].selection(batch, n, kv) for name in names}
    picked = {name: pick for name, pick in chosen.items() if pick is not None}
    selected = [mask for _, mask in picked.values()]
    return LinearPlan(list(picked), [label for label, _ in picked.values()],
                      torch.stack(selected, dim=-1).float() if selected else batch.valid.new_zeros(0).float(),
                      torch.tensor([float(mask.sum()) for mask in selected], dtype=torch.float64))


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
        """Add one layer call from its queries, keys and log-sum-exp: the diagonals and columns the scores read
        computed first, in one pass; the scores that average one of them (LinearPlan) in one product; the others
        each by its `fast`."""
        batch = self._batch()
        n, kv = attention.shape[2:]
        plan = batch.memo(("linear plan", tuple(self.names), n, kv), lambda: linear_plan(self.names, batch, n, kv))
        attention.prefetch([shift for name in self.names for shift in SCORES[name].diagonals(batch)],
                           [key for name in self.names for key in SCORES[name].columns(batch)])
        if plan.names:
            table, columns = attention.covering(plan.labels)  # (b, h, n, w): a view, the labels' columns in it
            selection = batch.memo(("selection", tuple(self.names), n, kv, tuple(columns), table.shape[-1]),
                                   lambda: plan.selection(columns, table.shape[-1]).to(table))
            sums = torch.einsum("bhnw,bnws->sh", table, selection).double()
            for index, name in enumerate(plan.names):
                self._add(name, layer, sums[index], plan.counts[index].expand(table.shape[1]))
        for name in self.names:
            fast = SCORES[name].fast
            assert fast is not None, name
            if name not in plan.names:
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

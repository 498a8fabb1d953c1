"""Reducing attention into scores one block at a time, so that full patterns are never kept; or, on the fast path,
from each layer's fused statistics (probe.kernels), so that the weights are never formed at all."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from probe.heads.scores import SCORES, Batch
from probe.kernels.base import FusedStatistics
from probe.kernels.config import DEFAULT_CONFIG, KernelConfig
from probe.kernels.fused import Label, Weights, side_by_side, uploaded

BLOCKED = "blocked"


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


def _zeros(shape: tuple[int, ...], part: Tensor) -> Tensor:
    """Running sums float64 for parts like `part`: on a CUDA part's device (no host round-trip per layer; `result`
    fetches them), else on the CPU."""
    return torch.zeros(shape, dtype=torch.float64, device=part.device if part.device.type == "cuda" else "cpu")


def _add_at(total: Tensor, layers: list[int], part: Tensor, dim: int = 0) -> None:
    """total[layers] += part along `dim`: one addition where the layers are consecutive (a slice: no index tensor
    copied to the device), else one per layer (python integers: nothing sent to the device either)."""
    part = part.to(total.device)
    if layers == list(range(layers[0], layers[-1] + 1)):
        total.narrow(dim, layers[0], len(layers)).add_(part)
        return
    for index, layer in enumerate(layers):
        total.select(dim, layer).add_(part.select(dim, index) if part.shape[dim] > 1 else part.select(dim, 0))


class ScoreAccumulator:
    """Running sums and counts of several scores for every (layer, head), fed one block of weights at a time
    (`update`) or one layer call's fused statistics (`__call__`, from the `lse` hook point). `config` tunes the
    fast path (KernelConfig: chunk sizes and stages, never a number), the one `attention_hooks(config=...)` runs
    the backends with."""

    def __init__(self, names: list[str], n_layers: int, n_heads: int, config: KernelConfig = DEFAULT_CONFIG) -> None:
        self.names = names
        self.config = config
        self.sums: dict[str, Tensor] = {}
        self.counts: dict[str, Tensor] = {}
        self.shape = (n_layers, n_heads)
        self.pending: list[tuple[int, FusedStatistics]] = []  # layer calls held back, read together by `flush`
        self._current: Batch | None = None
        self.paths: dict[int, tuple[bool, str]] = {}  # layer -> (fast, the backend that served or why it went blocked)
        self.stacks: dict[tuple[str, ...], tuple[Tensor, Tensor]] = {}  # a LinearPlan's running sums and counts,
        # (scores, n_layers, h) each: the rows of `sums` and `counts` of its scores

    @property
    def batch(self) -> Batch | None:
        """The batch the coming layer calls belong to (setting it reads the calls held back for the last one)."""
        return self._current

    @batch.setter
    def batch(self, batch: Batch | None) -> None:
        self.flush()
        self._current = batch

    @property
    def fast(self) -> bool:
        """Whether every score has a fast path (otherwise every layer runs the blocked path)."""
        return all(SCORES[name].fast is not None for name in self.names)

    def _add(self, name: str, layers: list[int], sums: Tensor, counts: Tensor) -> None:
        """Add sums and counts (len(layers), ...) of `layers`."""
        if name not in self.sums:
            self.sums[name], self.counts[name] = (_zeros((self.shape[0], *part.shape[1:]), part)
                                                  for part in (sums, counts))
        _add_at(self.sums[name], layers, sums)
        _add_at(self.counts[name], layers, counts)

    def _add_plan(self, plan: LinearPlan, layers: list[int], sums: Tensor, counts: Tensor) -> None:
        """Add the plan's scores' sums (scores, len(layers), h) and counts (scores,) of `layers` in one addition each:
        their running sums are one stacked tensor (each score's `sums[name]` a view of its row), made on the first
        call; where a score's sums exist apart already (a layer read blocked first), each is added on its own."""
        stacked = self.stacks.get(tuple(plan.names))
        if stacked is None and not any(name in self.sums for name in plan.names):
            shape = (len(plan.names), self.shape[0], sums.shape[-1])
            stacked = self.stacks[tuple(plan.names)] = (_zeros(shape, sums), _zeros(shape, sums))
            for index, name in enumerate(plan.names):
                self.sums[name], self.counts[name] = stacked[0][index], stacked[1][index]
        if stacked is None:
            for index, name in enumerate(plan.names):
                self._add(name, layers, sums[index], counts[index, None, None].expand_as(sums[index]))
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
            self._add(name, [layer], sums[None], counts[None])

    def __call__(self, layer: int, attention: FusedStatistics) -> None:
        """Add one layer call from its queries, keys and log-sum-exp: read now, or held back and read with the next
        calls (`flush`: their heads side by side, one pass for them all) where a score can read a group and the
        group's queries and keys stay within config.group_bytes."""
        groups = self._groups(attention)  # asks for the batch: fails before the forward goes on without one
        held_back = self.pending[0][1] if self.pending else attention
        if not groups or (attention.shape, attention.causal, attention.scaling) != (
                held_back.shape, held_back.causal, held_back.scaling):
            self.flush()
        self.pending.append((layer, attention))
        held = sum(call.query.nbytes + call.key.nbytes for _, call in self.pending)
        if not groups or held >= self.config.group_bytes or layer == self.shape[0] - 1:
            self.flush()

    def _groups(self, attention: FusedStatistics) -> bool:
        """Whether this layer call may be read with others (side_by_side): no mask beyond causal (no bias, key mask
        or window), and a score reads layer groups
        (one diagonal or column, LinearPlan, or declared layers_at_once; the others read each call of a group alone,
        and cost only themselves the grouping)."""
        return attention.plain and bool(self._grouping(attention))

    def _grouping(self, attention: FusedStatistics) -> list[str]:
        """The scores that read a group of layer calls as one: one diagonal or column, or declared layers_at_once."""
        linear = self._plan(attention).names
        return [name for name in self.names if name in linear or SCORES[name].layers_at_once]

    def _plan(self, attention: FusedStatistics) -> LinearPlan:
        """The batch's LinearPlan for this call's number of queries and keys (made once per batch)."""
        batch, (n, kv) = self._batch(), attention.shape[2:]
        return batch.memo(("linear plan", tuple(self.names), n, kv), lambda: linear_plan(self.names, batch, n, kv))

    def flush(self) -> None:
        """Read the layer calls held back, as one call with their heads side by side: the diagonals and columns the
        scores read computed in one pass, the scores that average one of them (LinearPlan) in one product, the
        others each by its `fast`; a score that does not read groups (not layers_at_once) reads each call alone."""
        if not self.pending:
            return
        layers = [layer for layer, _ in self.pending]
        calls = [call for _, call in self.pending]
        self.pending = []
        if len(calls) == 1:
            self._read(layers, calls[0], self.names)
            return
        grouping = self._grouping(calls[0])
        self._read(layers, side_by_side(calls), grouping)
        alone = [name for name in self.names if name not in grouping]
        for layer, call in zip(layers, calls) if alone else ():
            self._read([layer], call, alone)

    def _read(self, layers: list[int], statistics: FusedStatistics, names: list[str]) -> None:
        """Add the scores `names` of `layers`, read as one call `statistics` (its Weights: read the same way for every
        backend), the diagonals and columns each score reads of this record (`Score.reads`: its own, and what the
        record's search reads for it) computed first in one pass."""
        batch, (n, kv), plan = self._batch(), statistics.shape[2:], self._plan(statistics)
        attention = Weights(statistics)
        reads = [SCORES[name].reads(batch, attention) for name in names]  # what each score reads of this record
        attention.prefetch([shift for offsets, _ in reads for shift in offsets],
                           [key for _, keys in reads for key in keys])
        if plan.names and plan.names[0] in names:  # the linear scores are read with the group's first reading
            table, columns = attention.covering(plan.labels)  # (b, h, n, w): the labels' columns in it
            selection = batch.memo(("selection", tuple(self.names), n, kv, tuple(columns), table.shape[-1]),
                                   lambda: uploaded(plan.selection(columns, table.shape[-1]).to(table.dtype),
                                                    table.device))
            sums = torch.einsum("bhnw,bnws->sh", table, selection).double().unflatten(-1, (len(layers), -1))
            self._add_plan(plan, layers, sums, batch.memo(("plan counts", tuple(self.names), n, kv, str(table.device)),
                                                          lambda: uploaded(plan.counts, table.device)))
        for name in names:
            fast = SCORES[name].fast
            assert fast is not None, name
            if name not in plan.names:
                sums, counts = fast(attention, batch)
                self._add(name, layers, *(part.unflatten(-1, (len(layers), -1)).movedim(-2, 0)
                                          for part in (sums, counts)))
        for layer in layers:
            self.paths.setdefault(layer, (True, attention.backend))

    def blocked(self, layer: int, reason: str) -> None:
        """The layer's weights go to `update` instead, for `reason`."""
        self.flush()
        self.paths[layer] = (False, reason)

    def path(self) -> str:
        """Which way the scores were computed: the backend that served every layer ("cpu"), "blocked" (every layer,
        weights), or "cpu; blocked at layers ...: reason" for the layers no backend could serve."""
        self.flush()
        if not self.paths:
            return BLOCKED
        served = ", ".join(dict.fromkeys(how for fast, how in self.paths.values() if fast))
        reasons: dict[str, list[int]] = {}
        for layer, (fast, how) in sorted(self.paths.items()):
            if not fast:
                reasons.setdefault(how, []).append(layer)
        parts = "; ".join(f"blocked at layers {', '.join(map(str, layers))}: {reason}"
                          for reason, layers in reasons.items())
        return "; ".join(part for part in (served, parts) if part)

    def result(self) -> dict[str, Tensor]:
        """{name: (n_layers, n_heads) float64}, each score finished by its own `finish`."""
        self.flush()
        return {name: SCORES[name].finish(self.sums[name].cpu(), self.counts[name].cpu()) for name in self.names}

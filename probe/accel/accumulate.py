"""Scores from each layer call's fused statistics (probe.kernels), the weights never formed: each class by its
accelerator, into the running sums of probe.heads.accumulate; layers no backend serves go to the blocked reduce."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from probe.accel.registry import ACCELERATORS, Accelerator
from probe.heads.accumulate import BLOCKED, ScoreAccumulator
from probe.heads.scores import Batch
from probe.kernels.base import DEFAULT_CONFIG, FusedStatistics, KernelConfig
from probe.kernels.fused import Label, Weights, side_by_side, uploaded


@dataclass(frozen=True)
class LinearPlan:
    """The classes that average one diagonal or column over selected queries: read in one product per layer."""

    names: list[str]
    labels: list[Label]  # the diagonal or column each class reads
    selected: Tensor  # (b, n, len(names)) float: 1 where query i counts for class s
    counts: Tensor  # (len(names),) float64: the queries each class counts

    def selection(self, columns: list[int], width: int) -> Tensor:
        """(b, n, width, len(names)): each class's selection on its label's column of a table `width` wide."""
        b, n, count = self.selected.shape
        out = self.selected.new_zeros(b, n, width, count)
        for index, column in enumerate(columns):
            out[:, :, column, index] = self.selected[..., index]
        return out


def linear_plan(entries: dict[str, Accelerator], batch: Batch, n: int, kv: int) -> LinearPlan:
    """The LinearPlan of the accelerators that have a selection (the others compute their own sums)."""
    chosen = {name: entry.selection(batch, n, kv) for name, entry in entries.items()}
    picked = {name: pick for name, pick in chosen.items() if pick is not None}
    selected = [mask for _, mask in picked.values()]
    return LinearPlan(list(picked), [label for label, _ in picked.values()],
                      torch.stack(selected, dim=-1).float() if selected else batch.valid.new_zeros(0).float(),
                      torch.tensor([float(mask.sum()) for mask in selected], dtype=torch.float64))


class FusedAccumulator(ScoreAccumulator):
    """ScoreAccumulator that also reads layer calls' fused statistics (`__call__`, from the `lse` hook point), every
    class by its accelerator; a layer no backend serves is `blocked` and its blocks go to `update`."""

    def __init__(self, names: list[str], n_layers: int, n_heads: int, config: KernelConfig = DEFAULT_CONFIG) -> None:
        super().__init__(names, n_layers, n_heads)
        self.entries = {name: ACCELERATORS[name] for name in names if name in ACCELERATORS}  # others: blocked
        self.config = config
        self.pending: list[tuple[int, FusedStatistics]] = []  # layer calls held back, read together by `flush`
        self.paths: dict[int, tuple[bool, str]] = {}  # layer -> (fast, the backend that served or why it went blocked)

    def __call__(self, layer: int, attention: FusedStatistics) -> None:
        """Add one layer call: read now, or held back to be read with the next (`flush`) up to config.group_bytes."""
        self._batch()  # fails before the forward goes on without one
        groups = attention.plain and bool(self._grouping())  # no mask beyond causal, and a class reads groups
        held_back = self.pending[0][1] if self.pending else attention
        if not groups or (attention.shape, attention.causal, attention.scaling) != (
                held_back.shape, held_back.causal, held_back.scaling):
            self.flush()
        self.pending.append((layer, attention))
        held = sum(call.query.nbytes + call.key.nbytes for _, call in self.pending)
        if not groups or held >= self.config.group_bytes or layer == self.shape[0] - 1:
            self.flush()

    def _grouping(self) -> list[str]:
        """The classes that read a group of layer calls as one (`layers_at_once`)."""
        return [name for name, entry in self.entries.items() if entry.layers_at_once]

    def _plan(self, attention: FusedStatistics) -> LinearPlan:
        """The batch's LinearPlan for this call's number of queries and keys (made once per batch)."""
        batch, (n, kv) = self._batch(), attention.shape[2:]
        return batch.memo(("linear plan", tuple(self.names), n, kv), lambda: linear_plan(self.entries, batch, n, kv))

    def flush(self) -> None:
        """Read the layer calls held back as one (side_by_side); a class that does not read groups reads each alone."""
        if not self.pending:
            return
        layers = [layer for layer, _ in self.pending]
        calls = [call for _, call in self.pending]
        self.pending = []
        if len(calls) == 1:
            self._read(layers, calls[0], self.names)
            return
        grouping = self._grouping()
        self._read(layers, side_by_side(calls), grouping)
        alone = [name for name in self.names if name not in grouping]
        for layer, call in zip(layers, calls) if alone else ():
            self._read([layer], call, alone)

    def _read(self, layers: list[int], statistics: FusedStatistics, names: list[str]) -> None:
        """Add the classes `names` of `layers`, read as one call, what each reads prefetched in one pass."""
        batch, (n, kv), plan = self._batch(), statistics.shape[2:], self._plan(statistics)
        attention = Weights(statistics)
        reads = [self.entries[name].reads(attention, batch) for name in names]  # what each reads of this record
        attention.prefetch([shift for offsets, _ in reads for shift in offsets],
                           [key for _, keys in reads for key in keys])
        if plan.names and plan.names[0] in names:  # the linear classes are read with the group's first reading
            table, columns = attention.covering(plan.labels)  # (b, h, n, w): the labels' columns in it
            selection = batch.memo(("selection", tuple(self.names), n, kv, tuple(columns), table.shape[-1]),
                                   lambda: uploaded(plan.selection(columns, table.shape[-1]).to(table.dtype),
                                                    table.device))
            sums = torch.einsum("bhnw,bnws->sh", table, selection).double().unflatten(-1, (len(layers), -1))
            self.add_stacked(plan.names, layers, sums, batch.memo(
                ("plan counts", tuple(self.names), n, kv, str(table.device)),
                lambda: uploaded(plan.counts, table.device)))
        for name in names:
            if name not in plan.names:
                sums, counts = self.entries[name](attention, batch)
                self.add(name, layers, *(part.unflatten(-1, (len(layers), -1)).movedim(-2, 0)
                                         for part in (sums, counts)))
        for layer in layers:
            self.paths.setdefault(layer, (True, statistics.backend))

    def blocked(self, layer: int, reason: str) -> None:
        """The layer's weights go to `update` instead, for `reason`."""
        self.flush()
        self.paths[layer] = (False, reason)

    def path(self) -> str:
        """Which way the scores were computed: "cpu", "blocked", or "cpu; blocked at layers ...: reason"."""
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

"""Reference statistics of every head's output over a reference set (mean and noise ablation): one collector,
`head_statistics`, takes every statistic the methods declare in one pass; a statistic is an entry of STATISTICS."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from probe.hooks.capture import attention_hooks
from probe.hooks.run import run_model
from probe.hooks.types import HookContext
from probe.inputs import ProbeSet, real_tokens
from probe.errors import ProbeError
from probe.models import LoadedModel


@dataclass(frozen=True)
class Statistic:
    """A statistic over positions: the power sums sum(x^k) it needs (`powers`), finished by `finish(moments)`."""

    name: str
    powers: tuple[int, ...]
    finish: Callable[[dict[int, Tensor]], Tensor]


STATISTICS: dict[str, Statistic] = {statistic.name: statistic for statistic in (
    Statistic("mean", (1,), lambda moments: moments[1]),
    # the population's, sqrt(E[x^2] - E[x]^2), clamped at 0 against rounding
    Statistic("std", (1, 2), lambda moments: (moments[2] - moments[1] ** 2).clamp(min=0).sqrt()),
)}
"""Statistics by name; a method names the ones it reads."""


@dataclass
class HeadStatistics:
    """Statistics of every head: statistic -> layer -> (heads, head_dim), per position (positions, heads, head_dim)."""

    stats: dict[str, dict[int, Tensor]]
    per_position: bool
    source: str  # what the statistics were taken over, for reports

    @property
    def values(self) -> dict[int, Tensor]:
        """The means (mean ablation's reference values)."""
        return self.stats["mean"]

    def describe(self, names: Sequence[str] | None = None) -> str:
        """E.g. "mean over all positions of natural text", "per-position mean and std of ..."."""
        listed = " and ".join(names or self.stats)
        return f"per-position {listed} of {self.source}" if self.per_position else \
            f"{listed} over all positions of {self.source}"

    def at(self, name: str, layer: int, heads: Tensor) -> Tensor:
        """Statistic `name` of `layer`, broadcastable to `heads` (batch, positions, n_heads, head_dim)."""
        value = self.stats[name][layer]
        if self.per_position:
            if value.shape[0] < heads.shape[1]:
                raise ProbeError(f"per-position statistics cover {value.shape[0]} positions, the input has "
                                 f"{heads.shape[1]}: take them over sequences at least as long")
            value = value[: heads.shape[1]]
        return value.to(device=heads.device, dtype=heads.dtype)

    def check_holds(self, names: Sequence[str], method: str) -> None:
        missing = [name for name in names if name not in self.stats]
        if missing:
            raise ProbeError(f"{method} ablation reads the heads' {', '.join(missing)}, which the statistics given do "
                             f"not hold: take them with head_statistics(..., names={tuple(names)!r})",
                             parameter="statistics")

    def add_to_fingerprint(self, digest: hashlib._Hash, names: Sequence[str]) -> None:
        digest.update(str(self.per_position).encode())
        for name in names:
            for layer in sorted(self.stats[name]):
                _add_tensor(digest, self.stats[name][layer])


def _add_tensor(digest: hashlib._Hash, value: Tensor) -> None:
    """A tensor's exact bytes into a fingerprint in any dtype (through a uint8 view: numpy has no bfloat16)."""
    digest.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


HeadMeans = HeadStatistics
"""The name mean ablation's statistics had before there were others."""


class _Sums:
    """Float64 power sums of head outputs and counts of the positions that count, per layer and power."""

    def __init__(self, powers: set[int], per_position: bool) -> None:
        self.powers, self.per_position = sorted(powers), per_position
        self.sums: dict[tuple[int, int], Tensor] = {}  # (layer, power) -> sums
        self.counts: dict[int, Tensor] = {}
        self.valid: Tensor | None = None  # (batch, positions) of the batch running

    def record(self, heads: Tensor, ctx: HookContext) -> None:
        """A `z` reader. heads: (batch, positions, n_heads, head_dim)."""
        layer = ctx.layer
        assert self.valid is not None
        valid = self.valid.to(heads.device)
        values = heads.detach().double() * valid[:, :, None, None]
        reduce = (0,) if self.per_position else (0, 1)  # -> (positions, n_heads, head_dim) or (n_heads, head_dim)
        count = valid.sum(dim=reduce).double()
        self._add(self.counts, layer, count)
        for power in self.powers:
            self._add(self.sums, (layer, power), (values if power == 1 else values ** power).sum(dim=reduce))

    def _add(self, into: dict, key: object, total: Tensor) -> None:
        if key not in into:
            into[key] = torch.zeros_like(total)
        if self.per_position and total.shape[0] > into[key].shape[0]:  # a longer batch than the ones before: grow
            grow = total.shape[0] - into[key].shape[0]
            into[key] = F.pad(into[key], (0, 0) * (total.dim() - 1) + (0, grow))
        if self.per_position:
            into[key][: total.shape[0]] += total
        else:
            into[key] += total

    def moments(self, layer: int) -> dict[int, Tensor]:
        count = self.counts[layer].clamp(min=1)
        if self.per_position:
            count = count[:, None, None]
        return {power: self.sums[(layer, power)] / count for power in self.powers}


def head_statistics(loaded: LoadedModel, reference: ProbeSet, names: Sequence[str] = ("mean",), *,
                    per_position: bool = False, batch_size: int = 8) -> HeadStatistics:
    """The statistics `names` (of STATISTICS) of every head's output over the reference set, in one pass."""
    unknown = [name for name in names if name not in STATISTICS]
    if unknown:
        raise ProbeError(f"unknown statistic {unknown[0]!r}: use some of {', '.join(STATISTICS)}", parameter="names")
    sums = _Sums({power for name in names for power in STATISTICS[name].powers}, per_position)
    with torch.no_grad(), attention_hooks(loaded.model, {"z": sums.record}):
        for ids, mask in reference.batches(batch_size):
            sums.valid = real_tokens(ids, mask)
            run_model(loaded.model, ids, mask)
    stats = {name: {layer: STATISTICS[name].finish(sums.moments(layer)).float() for layer in sums.counts}
             for name in names}
    return HeadStatistics(stats, per_position, reference.description)


@dataclass
class HeadOutputs:
    """Each source batch's head outputs, to patch in: batch -> layer -> (rows, positions, heads, dim)."""

    values: list[dict[int, Tensor]]
    source: str  # what the run was, for reports

    def at(self, layer: int, heads: Tensor, batch: int | None) -> Tensor:
        """The source's head outputs of `layer` on batch `batch`, the shape of `heads`."""
        if batch is None or batch >= len(self.values):
            raise ProbeError("patching takes each batch's values from the same batch of the source run: run it as a "
                             "sweep over a probe set shaped like the source", parameter="method")
        value = self.values[batch][layer]
        if value.shape != heads.shape:
            raise ProbeError(f"the source run's head outputs of batch {batch} are {tuple(value.shape)}, the patched "
                             f"run's {tuple(heads.shape)}: the two runs need the same rows and token lengths",
                             parameter="method")
        return value.to(device=heads.device, dtype=heads.dtype)

    def add_to_fingerprint(self, digest: hashlib._Hash) -> None:
        for batch in self.values:
            for layer in sorted(batch):
                _add_tensor(digest, batch[layer])


def head_outputs(loaded: LoadedModel, source: ProbeSet, component: str = "output", *,
                 batch_size: int = 8) -> HeadOutputs:
    """Every head's output (rows, positions, n_heads, head_dim), or every layer's attention input `component` (query,
    key or value), on each batch of `source`, in one pass."""
    values: list[dict[int, Tensor]] = []

    def record(seen: Any, ctx: HookContext) -> None:
        values[-1][ctx.layer] = (seen if component == "output" else getattr(seen, component)).detach().clone()

    with torch.no_grad(), attention_hooks(loaded.model, {"z" if component == "output" else "inputs": record}):
        for ids, mask in source.batches(batch_size):
            values.append({})
            run_model(loaded.model, ids, mask, logits=False)
    return HeadOutputs(values, source.description)


def head_means(loaded: LoadedModel, reference: ProbeSet, *, per_position: bool = False,
               batch_size: int = 8) -> HeadStatistics:
    """Every head's mean output over the reference set (mean ablation's reference values)."""
    return head_statistics(loaded, reference, ("mean",), per_position=per_position, batch_size=batch_size)

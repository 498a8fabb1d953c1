"""Mean head outputs over a reference set, for mean ablation."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from probe.attention import attention_hooks, run_model
from probe.data import ProbeSet, real_tokens
from probe.models import LoadedModel


@dataclass
class HeadMeans:
    """Mean output of every head of every layer over a reference set: layer -> (heads, head_dim), or with
    `per_position` layer -> (positions, heads, head_dim)."""

    values: dict[int, Tensor]
    per_position: bool
    source: str  # what the mean was taken over, for reports

    def describe(self) -> str:
        kind = "per-position mean" if self.per_position else "mean over all positions"
        return f"{kind} of {self.source}"


class _Sums:
    """Float64 sums of head outputs and counts of the positions that count, per layer."""

    def __init__(self, per_position: bool) -> None:
        self.per_position = per_position
        self.sums: dict[int, Tensor] = {}
        self.counts: dict[int, Tensor] = {}
        self.valid: Tensor | None = None  # (batch, positions) of the batch running

    def record(self, layer: int, heads: Tensor) -> Tensor:
        """An edit_heads function that changes nothing. heads: (batch, positions, n_heads, head_dim)."""
        assert self.valid is not None
        valid = self.valid.to(heads.device)
        values = heads.detach().double() * valid[:, :, None, None]
        if self.per_position:
            total, count = values.sum(dim=0), valid.sum(dim=0).double()  # (positions, n_heads, head_dim), (positions,)
        else:
            total, count = values.sum(dim=(0, 1)), valid.sum().double()  # (n_heads, head_dim), ()
        if layer not in self.sums:
            self.sums[layer], self.counts[layer] = torch.zeros_like(total), torch.zeros_like(count)
        if self.per_position:
            if total.shape[0] > self.sums[layer].shape[0]:  # a longer batch than the ones before: grow
                grow = total.shape[0] - self.sums[layer].shape[0]
                self.sums[layer] = F.pad(self.sums[layer], (0, 0, 0, 0, 0, grow))
                self.counts[layer] = F.pad(self.counts[layer], (0, grow))
            self.sums[layer][: total.shape[0]] += total
            self.counts[layer][: total.shape[0]] += count
        else:
            self.sums[layer] += total
            self.counts[layer] += count
        return heads

    def means(self) -> dict[int, Tensor]:
        values = {}
        for layer, total in self.sums.items():
            count = self.counts[layer].clamp(min=1)
            values[layer] = (total / (count[:, None, None] if self.per_position else count)).float()
        return values


def head_means(loaded: LoadedModel, reference: ProbeSet, *, per_position: bool = False,
               batch_size: int = 8) -> HeadMeans:
    """Every head's mean output over the reference set (one forward pass over it, nothing changed)."""
    sums = _Sums(per_position)
    with torch.no_grad(), attention_hooks(loaded.model, edit_heads=sums.record):
        for ids, mask in reference.batches(batch_size):
            sums.valid = real_tokens(ids, mask)
            run_model(loaded.model, ids, mask)
    return HeadMeans(sums.means(), per_position, reference.description)

"""Neuronpedia HeadVis's six per-head metrics (after Luger, Kamath et al. 2026; HeadVis's definitions, as
HeadMetricsEntry states them), from fused statistics where a backend serves a layer (no weights formed), else from
blocks of eager weights (`update`); beside them each (sequence, head)'s max_activation for the data tree."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import Tensor

from probe.accel.registry import with_key
from probe.heads.scores import selected_sums
from probe.kernels.base import FusedStatistics, float32_copy
from probe.kernels.fused import Label, Weights
from probe.kernels.moments import moments_of

METRICS = ("self_attention_score", "prev_token_score", "pattern_entropy", "qk_distance", "qk_distance_variance",
           "induction_score")
SUMS = ("self", "previous", "entropy", "distance", "squared_distance", "induction")
INDUCTION_THRESHOLD = 0.01  # induction weights under it count 0 (HeadVis's default)
TINY = torch.finfo(torch.float32).tiny  # the entropy's clamp
QUERIES_AT_ONCE = 128  # queries of one token's occurrences whose induction logits are computed at once


def induction_pairs(tokens: list[int]) -> tuple[Tensor, Tensor, int]:
    """(queries, keys, repeated): the pair (i, p + 1) for every earlier position p of i's token."""
    seen: dict[int, list[int]] = defaultdict(list)
    queries: list[int] = []
    keys: list[int] = []
    repeated = 0
    for position, token in enumerate(tokens):
        earlier = seen[token]
        if earlier:
            repeated += 1
            queries.extend([position] * len(earlier))
            keys.extend(before + 1 for before in earlier)
        earlier.append(position)
    return torch.tensor(queries, dtype=torch.long), torch.tensor(keys, dtype=torch.long), repeated


@dataclass
class Sequences:
    """What the metrics need of one batch: its valid tokens and its induction pairs."""

    valid: Tensor  # (b, n) bool: the tokens of sequences with at least two
    pairs: list[tuple[int, Tensor, Tensor]]  # (sequence, queries, keys) with at least one pair
    groups: list[tuple[int, Tensor, Tensor]]  # (sequence, positions (g, c), real (g, c)): occurrence_groups'
    counts: Tensor  # (3,) float64: valid queries, valid queries after the first, queries with an earlier occurrence

    @classmethod
    def of(cls, ids: Tensor, valid: Tensor) -> Sequences:
        """The batch's ids (b, n) and real tokens (b, n) bool (right padding)."""
        lengths = valid.sum(dim=1)
        valid = valid & (lengths >= 2)[:, None]
        pairs, groups, repeated = [], [], 0
        for row, length in enumerate(lengths.tolist()):
            if length < 2:
                continue
            queries, keys, count = induction_pairs(ids[row, :length].tolist())
            repeated += count
            if len(queries):
                pairs.append((row, queries, keys))
                groups += [(row, *bucket) for bucket in occurrence_groups(ids[row, :length])]
        used = lengths[lengths >= 2].double()
        return cls(valid, pairs, groups, torch.tensor([used.sum(), (used - 1).sum(), repeated], dtype=torch.float64))


def occurrence_groups(tokens: Tensor) -> list[tuple[Tensor, Tensor]]:
    """The positions of each repeated token, as rows padded to a power of two, one (positions, real) per width:
    every induction pair is two positions of one row."""
    order = torch.argsort(tokens, stable=True)  # positions by token, in order within each token
    counts = torch.unique_consecutive(tokens[order], return_counts=True)[1]
    buckets: dict[int, list[Tensor]] = defaultdict(list)
    for group in order.split(counts.tolist()):
        if len(group) > 1:
            buckets[1 << (len(group) - 1).bit_length()].append(group)
    out = []
    for width, found in sorted(buckets.items()):
        positions = torch.zeros(len(found), width, dtype=torch.long)
        real = torch.zeros(len(found), width, dtype=torch.bool)
        for index, group in enumerate(found):
            positions[index, :len(group)], real[index, :len(group)] = group, True
        out.append((positions, real))
    return out


class HeadVisSums:
    """The metrics' running sums per (layer, head); `batch` is set before each batch's forward. `paths`: {layer: the
    backend that served it, or why it went blocked}."""

    def __init__(self, n_layers: int, n_heads: int) -> None:
        self.sums = torch.zeros(len(SUMS), n_layers, n_heads, dtype=torch.float64)
        self.counts = torch.zeros(3, dtype=torch.float64)
        self.largest: list[Tensor] = []  # per batch: (valid sequences, n_layers, n_heads) max_activation
        self._largest: Tensor | None = None
        self._batch: Sequences | None = None
        self.paths: dict[int, str] = {}

    @property
    def batch(self) -> Sequences | None:
        return self._batch

    @batch.setter
    def batch(self, batch: Sequences | None) -> None:
        self._close()
        self._batch = batch
        if batch is not None:
            self.counts += batch.counts
            self._largest = torch.zeros(batch.valid.shape[0], *self.sums.shape[1:])

    def _close(self) -> None:
        if self._batch is not None and self._largest is not None:
            self.largest.append(self._largest[self._batch.valid.any(dim=1)])
        self._largest = None

    def _current(self) -> Sequences:
        if self._batch is None:
            raise RuntimeError("set HeadVisSums.batch before the forward pass")
        return self._batch

    def _add(self, layer: int, parts: list[Tensor], largest: Tensor) -> None:
        """Add the layer call's sums (SUMS order, (h,) each) and its (b, h) largest weights."""
        heads = parts[0].shape[0]
        self.sums[:, layer, :heads] += torch.stack([part.double().cpu() for part in parts])
        assert self._largest is not None
        current = self._largest[:, layer, :heads]
        torch.maximum(current, largest.float().cpu(), out=current)

    def __call__(self, layer: int, statistics: FusedStatistics) -> None:
        """Add one layer call from its fused statistics: no weights formed."""
        batch = self._current()
        self.paths[layer] = statistics.backend
        weights = Weights(statistics)
        b, h, n, kv = weights.shape
        device = statistics.lse.device
        valid = batch.valid.to(device)[:, :n]
        weights.prefetch((0, -1))
        diagonals = weights.stacked([Label("diagonal", 0), Label("diagonal", -1)])
        own = selected_sums(diagonals[..., 0], valid)[0]
        previous = selected_sums(diagonals[..., 1], with_key(batch.valid, n, kv, -1).to(device))[0]
        moments = moments_of(statistics)  # (b, h, n, 4)
        rows = valid[:, None, :].to(moments.dtype)
        entropy = ((statistics.lse - moments[..., 0]).nan_to_num(0.0) * rows).sum(dim=(0, 2))
        distance, squared = ((moments[..., 1:3] * rows[..., None]).sum(dim=(0, 2))).unbind(-1)
        past_first = rows.clone()
        past_first[..., 0] = 0.0
        largest = (torch.exp(moments[..., 3] - statistics.lse).nan_to_num(0.0) * past_first).amax(dim=-1)
        induction = sum((_group_weights(statistics, row, positions, real) for row, positions, real in batch.groups),
                        torch.zeros(h, dtype=torch.float64, device=device))
        self._add(layer, [own, previous, entropy, distance, squared, induction], largest)

    def blocked(self, layer: int, reason: str) -> None:
        self.paths[layer] = f"blocked ({reason})"

    def update(self, layer: int, start: int, weights: Tensor) -> None:
        """Add one block of eager weights (b, h, block, kv) float32 of `layer`, its first query at `start`."""
        batch = self._current()
        self.paths.setdefault(layer, "blocked")
        b, h, block, kv = weights.shape
        valid = batch.valid.to(weights.device)
        queries = torch.arange(start, start + block, device=weights.device)
        keys = torch.arange(kv, device=weights.device)
        rows, seen = valid[:, start:start + block], valid[:, :kv]
        pairs = (rows[:, :, None] & seen[:, None, :])[:, None]  # (b, 1, block, kv)
        masked = weights.masked_fill(~pairs, 0.0)
        distance = (queries[:, None] - keys[None, :]).abs().float()
        entropy = -(masked * torch.log(masked.clamp_min(TINY))).sum(dim=(0, 2, 3))
        own = selected_sums(_diagonal(weights, start, 0), rows)[0]
        before = with_key(valid, valid.shape[1], kv, -1)[:, start:start + block]
        previous = selected_sums(_diagonal(weights, start, -1), before)[0]
        inner = pairs & (queries != 0)[None, None, :, None] & (keys != 0)[None, None, None, :]
        largest = weights.masked_fill(~inner, 0.0).amax(dim=(-2, -1))
        induction = torch.zeros(h, dtype=torch.float64, device=weights.device)
        for row, pair_queries, pair_keys in batch.pairs:
            inside = (pair_queries >= start) & (pair_queries < start + block)
            values = weights[row][:, pair_queries[inside] - start, pair_keys[inside]]
            induction += values.masked_fill(values < INDUCTION_THRESHOLD, 0.0).sum(dim=-1).double()
        self._add(layer, [own, previous, entropy, (masked * distance).sum(dim=(0, 2, 3)),
                          (masked * distance.square()).sum(dim=(0, 2, 3)), induction], largest)

    def result(self) -> tuple[dict[str, Tensor], Tensor]:
        """({metric: (n_layers, n_heads) float64}, max_activation (valid sequences, n_layers, n_heads))."""
        self._close()
        self._batch = None
        return finish(self.sums, self.counts), torch.cat(self.largest) if self.largest else torch.zeros(0)


def _diagonal(weights: Tensor, start: int, shift: int) -> Tensor:
    """(b, h, block) A[i, i + shift] of a block's queries, 0 where the key does not exist."""
    b, h, block, kv = weights.shape
    out = weights.new_zeros(b, h, block)
    queries = torch.arange(start, start + block, device=weights.device)
    exists = (queries + shift >= 0) & (queries + shift < kv)
    out[..., exists] = weights[:, :, exists.nonzero()[:, 0], (queries + shift)[exists]]
    return out


def _group_weights(statistics: FusedStatistics, row: int, positions: Tensor, real: Tensor) -> Tensor:
    """(h,) float64: sequence `row`'s induction weights summed, from the logits of those queries and keys alone (one
    product per row of occurrences, not one per pair) and the log-sum-exp."""
    query, key, lse = statistics.query[row], statistics.key[row], statistics.lse[row]  # (hq, n, d), (hk, kv, d)
    hq, hk, d = query.shape[0], key.shape[0], query.shape[-1]
    positions, real = positions.to(lse.device), real.to(lse.device)
    groups, width = positions.shape
    keys = (positions + 1).clamp(max=key.shape[1] - 1)  # a last occurrence's key is never read
    k = float32_copy(key[:, keys.reshape(-1)]).view(hk, 1, groups, width, d).transpose(-1, -2)
    earlier = torch.ones(width, width, dtype=torch.bool, device=lse.device).tril(-1)
    counted = earlier & real[:, :, None] & real[:, None, :]  # (g, c, c): query a, key after occurrence b < a
    total = torch.zeros(hq, dtype=torch.float64, device=lse.device)
    for first in range(0, width, QUERIES_AT_ONCE):
        rows = positions[:, first:first + QUERIES_AT_ONCE]
        q = float32_copy(query[:, rows.reshape(-1)]).view(hk, hq // hk, groups, rows.shape[1], d)
        logits = torch.matmul(q, k).reshape(hq, groups, rows.shape[1], width) * statistics.scaling
        pairs = (rows[:, :, None].expand(-1, -1, width).reshape(-1), keys[:, None, :].expand_as(
            counted[:, first:first + QUERIES_AT_ONCE]).reshape(-1))
        logits = logits + _pair_bias(statistics, row, *pairs).view(-1, groups, rows.shape[1], width)
        values = torch.exp(logits - lse[:, rows][..., None])
        hidden = ~counted[:, first:first + QUERIES_AT_ONCE] | (values < INDUCTION_THRESHOLD)
        total += values.masked_fill(hidden, 0.0).sum(dim=(1, 2, 3)).double()
    return total


def _pair_bias(statistics: FusedStatistics, row: int, rows: Tensor, columns: Tensor) -> Tensor:
    """The mask's additive part at the pairs (hq or 1, pairs): the bias, or -inf where a key is hidden."""
    if statistics.bias is not None:
        bias = statistics.bias[row if statistics.bias.shape[0] > 1 else 0]  # (hq or 1, n or 1, kv)
        return bias[:, rows if bias.shape[1] > 1 else 0, columns].float()
    n, kv = statistics.query.shape[2], statistics.key.shape[2]
    hidden = torch.zeros(len(rows), dtype=torch.bool, device=rows.device)
    if statistics.key_mask is not None:
        hidden |= ~statistics.key_mask[row, columns].to(rows.device)
    if statistics.window is not None:
        hidden |= columns <= rows + kv - n - statistics.window
    return torch.zeros(len(rows), device=rows.device).masked_fill(hidden, float("-inf"))[None]


def finish(sums: Tensor, counts: Tensor) -> dict[str, Tensor]:
    """The metrics from the running sums and counts (NaN where nothing was counted)."""
    named = dict(zip(SUMS, sums))

    def mean(total: Tensor, count: Tensor) -> Tensor:
        return total / count if count > 0 else torch.full_like(total, float("nan"))

    positions, previous, repeated = counts
    distance = mean(named["distance"], positions)
    return {"self_attention_score": mean(named["self"], positions),
            "prev_token_score": mean(named["previous"], previous),
            "pattern_entropy": mean(named["entropy"], positions),
            "qk_distance": distance,
            "qk_distance_variance": mean(named["squared_distance"], positions) - distance.square(),
            "induction_score": mean(named["induction"], repeated)}

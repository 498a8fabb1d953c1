"""The CPU backend: the fused kernel (`aten._scaled_dot_product_flash_attention_for_cpu`, which returns the log-sum-exp
with the output) and `StagedSearch`, which answers whether a key is its row's top by stages instead of whole rows.

The stages: (1) every row against its rivals, a few diagonals and key 0 from one prefetched table; past `band_from`
keys (2) the band of nearby keys; past `witnesses_from` (3) the likely witnesses; past `near_from` (4) a slice of
keys near each row; (5) the rest, whole (bounded in bfloat16 first from `bounds_from` keys where the CPU has it).
Every stage decides a row only where it is sure, so the answer is argmax's exactly.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import Tensor

from probe.kernels.base import (DEFAULT_CONFIG, AttentionCall, FusedStatistics, KernelConfig, float32_copy,
                                rebuild_problem)
from probe.kernels.fused import Label, Weights, by_owner
from probe.kernels.moments import row_moments
from probe.kernels.sdpa import KERNELS, lse_forward

NAME = "cpu"


@dataclass(frozen=True)
class SearchConfig:
    """The staged search's thresholds: none changes a number (every stage decides a row only where it is sure), so a
    test forces a stage at a short length. Defaults are measured (bench/RESULTS.md)."""

    positional_band: int = 16  # keys i - 15 .. i + 1 (and key 0) whose weights decide most rows left open
    positional_rivals: tuple[int, ...] = (0, -2, -3, -4, -1, 1)  # offsets read for every row: cheap diagonals
    band_from: int = 1024  # keys past which the rows stage 1 left open go to the band; shorter rows go whole
    witnesses_from: int = 8192  # keys past which open rows are read against the witnesses (at 8192: break-even)
    first_keys: int = 256  # likely witnesses that beat the neighbour of a row the band leaves open: the first keys,
    longest_keys: int = 64  # and the longest keys of the key/value head (measured at 32768 tokens)
    near_from: int = 4096  # keys past which the open rows go to the near keys (below, the whole row is cheaper)
    near_span: int = 1024  # query positions of one bucket of the near-keys stage: its rows share one slice of keys
    near_before: int = 1024  # keys before a bucket that its slice includes
    margin: float = 1e-4  # a neighbour is surely the top when it outweighs the mass of the keys not computed by this
    bound: float = 2.0**-7  # bfloat16 upper bounds of logits: q . k + bound |q| |k| (roundings need <= 0.0059 |q||k|)
    # whether bounding whole rows pays here: a CPU with AVX512-BF16, whose bfloat16 matmuls are ~3x float32's
    bounds_on_cpu: bool = field(default_factory=lambda: bool(getattr(torch.cpu, "_is_avx512_bf16_supported",
                                                                     lambda: False)()))
    candidates: int = 64  # keys a bounded row may have whose bound reaches its key's logit: float32 logits decide
    bounds_from: int = 16384  # keys from which whole rows are bounded first (2.5x faster at 32768 keys)


DEFAULT_SEARCH = SearchConfig()
"""The search's thresholds where none are given."""


class CpuBackend:
    """CPU's flash-attention kernel; query, key and value padded to one head size (multi-head latent attention)."""

    name = NAME

    def __init__(self, search: SearchConfig = DEFAULT_SEARCH) -> None:
        self.search = StagedSearch(search)

    def problem(self, call: AttentionCall) -> str:
        """"" where the kernel serves the call, else why not."""
        device = call.query.device.type
        return rebuild_problem(call) or (f"no log-sum-exp kernel wired for {device} yet (CPU only)"
                                         if device != "cpu" else "")

    def run(self, call: AttentionCall, config: KernelConfig = DEFAULT_CONFIG) -> tuple[Tensor, FusedStatistics]:
        """The output (b, n, hq, dv) and its statistics; a key mask and window go as the dense bias they stand for."""
        call = call.with_dense_bias()
        output, lse = lse_forward(call, KERNELS["flash", "cpu"], max(call.query.shape[-1], call.value.shape[-1]))
        statistics = cpu_statistics(call.query, call.key, call.bias, call.scaling, call.causal and call.bias is None,
                                    lse, config, self.search)
        if config.moments:  # asked for (probe.headvis): from the log-sum-exp, a chunk of rows at a time
            statistics.moments = row_moments(statistics)
        return output, statistics


def cpu_statistics(query: Tensor, key: Tensor, bias: Tensor | None, scaling: float, causal: bool, lse: Tensor,
                   config: KernelConfig = DEFAULT_CONFIG, search: StagedSearch | None = None) -> FusedStatistics:
    """The CPU backend's record: float32 queries and keys (the search's bounds hold for any dtype), staged search."""
    return FusedStatistics(NAME, float32_copy(query), float32_copy(key), lse, scaling, causal, bias, config=config,
                           search=search or StagedSearch(DEFAULT_SEARCH))


@dataclass(frozen=True)
class StagedSearch:
    """The CPU's answer to neighbour_hits: cheap stages first, whole rows for the rest (state in `Weights.memo`)."""

    config: SearchConfig = field(default_factory=SearchConfig)

    def neighbour_hits(self, weights: Weights, selected: Tensor, shift: int) -> Tensor:
        """Weights.neighbour_hits by stages, each for the rows the one before left open (the module's docstring)."""
        config, kv = self.config, weights.shape[3]
        hit, unsure = self.rivals_stage(weights, selected.to(weights.lse.device), shift)
        hits = hit.sum(dim=(0, 2)).double().cpu()
        found = unsure.nonzero()  # (k, 3): b, h, query
        if len(found) and kv > config.band_from:
            band_hits, found = self.band_stage(weights, found, shift)
            hits += band_hits
        if len(found) and kv > config.witnesses_from:
            found = self.witness_stage(weights, found, shift)
        if len(found) and kv > config.near_from:
            near_hits, found = self.near_stage(weights, found, shift)
            hits += near_hits
        if len(found):
            hits += self.settle_stage(weights, found, shift)
        return hits

    def reads(self, statistics: FusedStatistics, shifts: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """RowSearch.reads: rivals_stage's diagonals (the neighbours', the rivals') and key 0."""
        return tuple(sorted({*shifts, *self.config.positional_rivals})), (0,)

    def rivals_stage(self, weights: Weights, selected: Tensor, shift: int) -> tuple[Tensor, Tensor]:
        """Stage 1 for the neighbour i + shift of every query: (hit, unsure) (b, h, n) from one table of the
        neighbour's, key 0's and the rivals' weights: the top when none beats it (an earlier key wins a tie) and it
        outweighs the mass of all other keys."""
        rivals = _rivals(weights.shape[2], shift, self.config.positional_rivals, weights.lse.device)
        table = weights.stacked(rivals.labels)  # (b, h, n, r + 2)
        earlier, weight, sink = rivals.earlier, table[..., rivals.earlier], table[..., -1]
        beats = (table[..., :earlier] >= weight[..., None]).any(dim=-1)
        beats |= (table[..., earlier + 1:-1] > weight[..., None]).any(dim=-1)
        beats |= (sink >= weight) & rivals.sink_rival
        computed = table[..., :-1].sum(dim=-1) + sink * rivals.sink_apart
        hit = ~beats & (weight > (1.0 - computed).clamp(min=0.0) + self.config.margin) & selected[:, None]
        return hit, ~beats & ~hit & selected[:, None]

    def band_stage(self, weights: Weights, found: Tensor, shift: int) -> tuple[Tensor, Tensor]:
        """Stage 2 for the (b, h, query) rows `found`: (hits per head, rows still open), from the band of keys
        i - 15 .. i + 1 and key 0: the top when it beats every other of them and the mass outside."""
        low = 1 - self.config.positional_band
        band = weights.band_of_rows(found, low, 1)  # (k, 17)
        sequence, head, row = found.unbind(1)
        first = torch.where(row + low > 0, weights.column(0)[sequence, head, row], -1.0)  # key 0 outside the band
        rest = (1.0 - band.sum(dim=-1) - first.clamp(min=0.0)).clamp(min=0.0)
        column = shift - low
        weight = band[:, column]
        beaten = first >= weight
        if column > 0:
            beaten |= band[:, :column].amax(dim=-1) >= weight
        if column + 1 < band.shape[-1]:
            beaten |= band[:, column + 1:].amax(dim=-1) > weight
        hit = ~beaten & (weight > rest + self.config.margin)
        hits = torch.bincount(head[hit].cpu(), minlength=weights.shape[1]).double()
        return hits, found[~beaten & ~hit]

    def witness_stage(self, weights: Weights, found: Tensor, shift: int) -> Tensor:
        """Stage 3 for the (b, h, query) rows `found`: those still open, less those a likely witness (the first and the
        longest keys: far from its row, a row's top is most often among them) surely beats."""
        config = self.config
        return found[~self.beaten_by_witnesses(weights, found, found[:, 2] + shift, config.first_keys,
                                               config.longest_keys)]

    def near_stage(self, weights: Weights, found: Tensor, shift: int) -> tuple[Tensor, Tensor]:
        """Stage 4 for the (b, h, query) rows `found`: (hits per head, rows still open), from the keys near each row
        (near_of_rows): beaten by a near key, or the top when none beats or ties it and it outweighs the rest."""
        b, h, n, kv = weights.shape
        long = found[:, 2] + kv - n >= self.config.near_from  # shorter rows: their whole row costs what a slice does
        near, short = found[long], found[~long]
        if not len(near):
            return torch.zeros(h, dtype=torch.float64), found
        sequence, head, row = near.unbind(1)
        beaten, tied, mass = self.near_of_rows(weights, near, row + shift)
        weight = weights.aligned(shift)[sequence, head, row]
        hit = ~beaten & ~tied & (weight > (1.0 - mass).clamp(min=0.0) + self.config.margin)
        hits = torch.bincount(head[hit].cpu(), minlength=h).double()
        return hits, torch.cat([short, near[~beaten & ~hit]])

    def settle_stage(self, weights: Weights, found: Tensor, shift: int) -> Tensor:
        """Hits per head among the (b, h, query) rows `found`, each row's logits computed whole (argmax's answer)."""
        top = weights.tops_of_rows(found, found[:, 2] + shift, functools.partial(self.tops, weights))
        return torch.bincount(found[top, 1].cpu(), minlength=weights.shape[1]).double()

    def near_of_rows(self, weights: Weights, found: Tensor, keys: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(beaten, tied, mass) (k,) for the (b, h, query) rows `found` (k, 3) and one key each, over the keys near each
        row: rows of one (sequence, key/value head) in one bucket of config.near_span positions share one slice of
        keys, from config.near_before keys before it. beaten: a key of the slice has a larger logit; tied: one equals
        it (argmax's tie rule needs the whole row); mass: the weight of the slice's visible keys and key 0."""
        b, hq, n, kv = weights.shape
        hk = weights.key.shape[1]
        position = found[:, 2] + kv - n  # each query's own key position
        span = self.config.near_span
        owner = ((found[:, 0] * hk + found[:, 1] // (hq // hk)) * (kv // span + 1)) + position // span
        beaten, tied, mass = by_owner(owner, functools.partial(self._near_part, weights), found, keys, position)
        return beaten, tied, mass

    def _near_part(self, weights: Weights, part: Tensor, keys: Tensor, position: Tensor
                   ) -> tuple[Tensor, Tensor, Tensor]:
        """near_of_rows for the rows of one (sequence, key/value head, bucket)."""
        sequence, kv_head = int(part[0, 0]), int(part[0, 1]) // (weights.shape[1] // weights.key.shape[1])
        low = max(0, int(position[0]) // self.config.near_span * self.config.near_span - self.config.near_before)
        logits = weights._row_logits(sequence, kv_head, part[:, 1], part[:, 2], low)  # (r, keys from low)
        rows = torch.arange(len(part), device=logits.device)
        own = logits[rows, keys - low]
        logits[rows, keys - low] = float("-inf")
        others = logits.amax(dim=-1)
        beaten, tied = others > own, others == own
        mass = torch.zeros_like(own)  # only the rows neither beaten nor tied need it: the others are settled
        weighed = ~beaten & ~tied
        if bool(weighed.any()):  # most rows: the mass of all (in place, no copy), kept for those
            lse = weights.lse[sequence, part[:, 1], part[:, 2]]
            mass = logits.sub_(lse[:, None]).exp_().sum(dim=-1) + torch.exp(own - lse)
            if low > 0:  # key 0 (the sink: often most of a row's weight) outside the slice
                mass += weights.column(0)[sequence, part[:, 1], part[:, 2]]
            mass = mass.where(weighed, 0.0)
        return beaten, tied, mass

    def beaten_by_witnesses(self, weights: Weights, found: Tensor, keys: Tensor, first: int, longest: int) -> Tensor:
        """(k,) bool: whether a likely witness the row found[t] may attend to beats keys[t] by more than float32's
        rounding (ties: False, left to the whole row). The witnesses: the `first` keys, where a far row's top most
        often lies (attention sinks, Xiao et al. 2023), and the `longest` keys; one matmul per key/value head."""
        if not len(found):
            return torch.zeros(0, dtype=torch.bool, device=found.device)
        hq, hk = weights.shape[1], weights.key.shape[1]
        owner = found[:, 0] * hk + found[:, 1] // (hq // hk)
        return by_owner(owner, lambda part, key: (self._beaten_part(weights, part, key, first, longest),),
                        found, keys)[0]

    def _witnesses(self, weights: Weights, sequence: int, kv_head: int, first: int, longest: int) -> Tensor:
        """The witnesses of one key/value head: the first keys, then the longest others (made once per call)."""
        index = ("witnesses", sequence, kv_head, first, longest)
        if index not in weights.memo:
            norms = weights._head_keys(sequence, kv_head)[first:].norm(dim=-1)
            longer = norms.topk(min(longest, len(norms))).indices.sort().values + first
            weights.memo[index] = torch.cat(
                [torch.arange(min(first, weights.shape[3]), device=longer.device), longer])
        return weights.memo[index]

    def _beaten_part(self, weights: Weights, part: Tensor, keys: Tensor, first: int, longest: int) -> Tensor:
        """beaten_by_witnesses for the rows of one (sequence, key/value head)."""
        sequence, kv_head = int(part[0, 0]), int(part[0, 1]) // (weights.shape[1] // weights.key.shape[1])
        head, row = part[:, 1], part[:, 2]
        head_keys = weights._head_keys(sequence, kv_head)
        witnesses = self._witnesses(weights, sequence, kv_head, first, longest)
        witness_keys = head_keys[witnesses]  # (witnesses, d)
        query = weights.query[sequence, head, row] * weights.scaling  # (r, d), scaled as the blocked path
        logits = query @ witness_keys.T  # (r, witnesses)
        own = (query * head_keys[keys]).sum(dim=-1)  # (r,)
        if weights.dense_bias is not None:
            bias = weights.dense_bias[sequence if weights.dense_bias.shape[0] > 1 else 0]  # (hq or 1, n or 1, kv)
            bias = bias[head if bias.shape[0] > 1 else 0, row if bias.shape[1] > 1 else 0].expand(len(part), -1)
            logits += bias[:, witnesses]
            own = own + bias.gather(1, keys[:, None])[:, 0]
        elif weights.causal:
            logits.masked_fill_(witnesses[None, :] > row[:, None] + weights.shape[3] - weights.shape[2], float("-inf"))
        norm = torch.maximum(witness_keys.norm(dim=-1).max(), head_keys[keys].norm(dim=-1))
        rounding = 2.0**-13 * (query.norm(dim=-1) * norm + own.abs())  # far above float32's, bias included
        return logits.amax(dim=-1) > own + rounding  # keys[t] among the witnesses: its logit is within rounding

    def tops(self, weights: Weights, batch: int, kv_head: int, heads: Tensor, rows: Tensor, keys: Tensor) -> Tensor:
        """Weights.tops, with bfloat16 bounds first (bounded_tops) for plain attention over config.bounds_from keys on
        a CPU with bfloat16 arithmetic; the rows they leave unsure from whole float32 rows (at least config.row_chunk
        of them: a matmul of one row rounds a copy of a key unlike the key)."""
        if weights.dense_bias is not None or not self.config.bounds_on_cpu or weights.query.device.type != "cpu" or \
                weights.shape[3] < self.config.bounds_from:
            return weights.tops(batch, kv_head, heads, rows, keys)
        top, unsure = weights._in_row_chunks(functools.partial(self.bounded_tops, weights), batch, kv_head, heads,
                                             rows, keys)
        if bool(unsure.any()):
            index = unsure.nonzero()[:, 0]
            padded = torch.cat([index, index[:1].expand(max(0, weights.config.row_chunk - len(index)))])
            top[index] = weights._in_row_chunks(weights._tops_chunk, batch, kv_head, heads[padded], rows[padded],
                                             keys[padded])[0][:len(index)]
        return top

    def bounded_tops(self, weights: Weights, batch: int, kv_head: int, heads: Tensor, rows: Tensor, keys: Tensor
                     ) -> tuple[Tensor, Tensor]:
        """(top, unsure) (len(rows),) bool, from upper bounds of the logits of keys 1 .. in one bfloat16 matmul
        (q . k plus config.bound |q| |k| as an extra dimension: a bound exceeds its logit by at least 0.0019 |q| |k|
        and at most 2 bound |q| |k|) and key 0's float32 logit (a sink's long key would loosen every bound). The key
        is the top when every bound and key 0's logit are below its logit, not when one beats it by more than the
        slack; the few keys whose bound reaches it decide the rest by float32 logits (_best_candidate); else unsure
        (ties, NaN, the neighbour at key 0, more than config.candidates such keys)."""
        offset = weights.shape[3] - weights.shape[2]
        limit = min(weights.shape[3], int(rows.max()) + offset + 1) if weights.causal else weights.shape[3]
        query = weights.query[batch, heads, rows] * weights.scaling  # (r, d) as _row_logits scales it
        head_keys = weights._head_keys(batch, kv_head)
        bounded_keys, longest = self._bounded_keys(weights, batch, kv_head)
        norm = query.norm(dim=-1)
        upper = torch.cat([query, self.config.bound * norm[:, None]], dim=1).to(torch.bfloat16) @ \
            bounded_keys[1:limit].T
        if weights.causal:  # (r, limit - 1): column c is key c + 1
            seen = int(rows.min()) + offset + 1
            hidden = torch.arange(seen, limit, device=upper.device)[None, :] > rows[:, None] + offset
            upper[:, seen - 1:].masked_fill_(hidden, float("-inf"))
        chunk = torch.arange(len(rows), device=rows.device)
        upper[chunk, (keys - 1).clamp(min=0)] = float("-inf")
        own = (query * head_keys[keys]).sum(dim=-1)  # (r,) the key's own float32 logit
        sink = query @ head_keys[0]  # (r,) key 0's
        highest = upper.amax(dim=-1).float() if upper.shape[1] else torch.full_like(own, float("-inf"))
        rounding = 2.0**-13 * norm * torch.maximum(longest, head_keys[0].norm())  # far above float32's
        below, above = own - rounding, own + rounding  # surely below / above the key's logit
        top = (highest < below) & (sink < below)
        beaten = (highest - 2 * self.config.bound * norm * longest > above) | (sink > above)
        unsure = (~top & ~beaten & (keys > 0) & ~highest.isnan()).nonzero()[:, 0]  # a NaN bound: the whole row
        if len(unsure):  # most have a key or two whose bound reaches theirs: those keys' float32 logits decide
            best = _best_candidate(upper[unsure], query[unsure], below[unsure], head_keys, self.config.candidates)
            top[unsure] = (best < below[unsure]) & (sink[unsure] < below[unsure])
            beaten[unsure] = (best > above[unsure]) | (sink[unsure] > above[unsure])
        return top & (keys > 0), ~top & ~beaten | (keys == 0)

    def _bounded_keys(self, weights: Weights, batch: int, kv_head: int) -> tuple[Tensor, Tensor]:
        """((kv, d + 1) bfloat16 keys and norms, the longest norm but key 0's) of one key/value head, once per call."""
        index = ("bounded", batch, kv_head)
        if index not in weights.memo:
            keys = weights._head_keys(batch, kv_head)
            norms = keys.norm(dim=-1, keepdim=True)
            weights.memo[index] = (torch.cat([keys, norms], dim=1).to(torch.bfloat16),
                                                   norms[1:].max() if len(keys) > 1 else norms.new_zeros(()))
        return weights.memo[index]

def _best_candidate(upper: Tensor, query: Tensor, threshold: Tensor, head_keys: Tensor, candidates: int
                    ) -> Tensor:
    """(r,) row t's largest float32 logit among keys whose bound reaches threshold[t] (NaN: over `candidates`)."""
    close = upper.float() >= threshold[:, None]  # (r, keys)
    many = close.sum(dim=-1) > candidates
    row, column = close.masked_fill_(many[:, None], False).nonzero(as_tuple=True)
    logits = (query[row] * head_keys[column + 1]).sum(dim=-1)
    best = torch.full_like(threshold, float("-inf")).scatter_reduce_(0, row, logits, "amax")
    return best.masked_fill_(many, float("nan"))


@dataclass(frozen=True)
class _Rivals:
    """Stage 1's reading of a neighbour i + shift: the table's columns (in prefetch's order, so a view) and, per query,
    whether key 0 is a rival and apart from the other rivals."""

    labels: list[Label]
    earlier: int  # rivals before the neighbour: columns 0 .. earlier - 1 (a tie goes to them); the neighbour next
    sink_rival: Tensor  # (n,) bool: the neighbour is not key 0
    sink_apart: Tensor  # (n,) float: 1 where key 0 is neither the neighbour nor a rival (its mass not counted yet)


@functools.lru_cache(maxsize=16)
def _rivals(n: int, shift: int, offsets: tuple[int, ...], device: torch.device) -> _Rivals:
    before = sorted(offset for offset in offsets if offset < shift)
    after = sorted(offset for offset in offsets if offset > shift)
    rows = torch.arange(n, device=device)
    keys = rows[:, None] + torch.tensor(before + after, dtype=torch.long, device=device)  # (n, r)
    sink_rival = rows + shift > 0
    labels = [Label("diagonal", offset) for offset in (*before, shift, *after)]
    return _Rivals([*labels, Label("column", 0)], len(before), sink_rival,
                   (sink_rival & (keys != 0).all(dim=-1)).float())

"""The weights of one layer call rebuilt from its statistics record: any `A[i, j] = exp(q_i . k_j * scale + bias_ij -
lse_i)` without the n x n matrix, a diagonal, column or band costing O(n x head_dim) per key offset and head.

`Weights` reads every backend's record the same way; whether a key holds a row's maximum it reads from the kernel's
top keys, or the record's `search`, or whole rows. `side_by_side` joins several layer calls' records into one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from probe.kernels.base import AttentionCall, FusedStatistics, float32_copy


class Label(NamedTuple):
    """Label("diagonal", shift): A[i, i + shift] for every query i; Label("column", key): A[i, key]."""

    kind: Literal["diagonal", "column"]
    at: int


class Weights:
    """The weights one layer call's statistics rebuild, read the same way whichever backend made the record, with what
    the reads cache (the prefetched table, contiguous keys per head, `memo` for a backend's search): the record
    stays plain."""

    def __init__(self, statistics: FusedStatistics) -> None:
        self.statistics = statistics
        self.query, self.key, self.lse = statistics.query, statistics.key, statistics.lse
        self.scaling, self.causal, self.config = statistics.scaling, statistics.causal, statistics.config
        self.bias = statistics.bias
        self.tables: dict[Label, tuple[Tensor, int]] = {}  # prefetched labels: (table (b, hq, n, w), column)
        self.memo: dict[Hashable, Any] = {}  # contiguous keys per head, what a backend's search keeps (once each)

    @functools.cached_property
    def dense_bias(self) -> Tensor | None:
        """The additive form of the mask (AttentionCall.dense_bias), made on the first read that needs it."""
        statistics = self.statistics
        return AttentionCall(self.query, self.key, self.key, statistics.bias, self.scaling, self.causal,
                             key_mask=statistics.key_mask, window=statistics.window).dense_bias()

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(batch, query heads, queries, keys)."""
        return self.statistics.shape

    def _finish(self, logits: Tensor, rows: Tensor | slice, keys: Tensor, lse: Tensor) -> Tensor:
        """logits (b, hq, m, k) of query rows and keys -> weights: bias added, causal keys zeroed."""
        if self.dense_bias is not None:
            bias = self.dense_bias[..., rows, :] if self.dense_bias.shape[-2] > 1 else self.dense_bias
            logits = logits + bias[..., keys]
        elif self.causal:
            positions = torch.arange(self.shape[2], device=logits.device)[rows] + self.shape[3] - self.shape[2]
            logits = logits.masked_fill(keys[None, :] > positions[:, None], float("-inf"))
        return torch.exp(logits.float() - lse[..., None])

    def aligned(self, shift: int) -> Tensor:
        """(b, hq, n): A[i, i + shift] for every query i, exactly 0 where the key does not exist or is hidden."""
        return self.stacked([Label("diagonal", shift)])[..., 0]

    def column(self, key: int) -> Tensor:
        """(b, hq, n): A[i, key] for every query i."""
        return self.stacked([Label("column", key)])[..., 0]

    def stacked(self, labels: list[Label]) -> Tensor:
        """(b, hq, n, len(labels)): the labels' weights, prefetched where they are not yet (a view where possible)."""
        table, columns = self.covering(labels)
        if columns == list(range(columns[0], columns[0] + len(columns))):  # a view (also: no index sent to a GPU)
            return table[..., columns[0]:columns[0] + len(columns)]
        return table.index_select(-1, _long_on(tuple(columns), table.device))

    def covering(self, labels: list[Label]) -> tuple[Tensor, list[int]]:
        """(table (b, hq, n, w), each label's column in it): a view of one prefetched table, else the labels stacked."""
        if any(label not in self.tables for label in labels):
            self.prefetch([shift for kind, shift in labels if kind == "diagonal"],
                          [key for kind, key in labels if kind == "column"])
        if len({id(self.tables[label][0]) for label in labels}) > 1:
            return torch.stack([self.tables[label][0][..., self.tables[label][1]] for label in labels],
                               dim=-1), list(range(len(labels)))
        table = self.tables[labels[0]][0]
        columns = [self.tables[label][1] for label in labels]
        low = min(columns)
        return table[..., low:max(columns) + 1], [column - low for column in columns]

    def prefetch(self, shifts: Iterable[int], columns: Iterable[int] = ()) -> None:
        """Compute the diagonals A[i, i + shift] and columns A[i, key] the scores will read in one table, one pass
        over the queries (many columns, a wide sink, through one matmul), so that scores reading the same pay once.
        Keys that do not exist or are hidden weigh exactly 0."""
        kv = self.shape[3]
        offsets = tuple(sorted({int(shift) for shift in shifts} - {shift for kind, shift in self.tables
                                                                     if kind == "diagonal"}))
        keys = tuple(sorted({int(key) for key in columns if 0 <= key < kv} - {key for kind, key in self.tables
                                                                             if kind == "column"}))
        wide = len(keys) > self.config.gathered_columns  # a wide sink: one matmul against the columns, not a gather
        for part_offsets, part_keys in [(offsets, ()), ((), keys)] if wide else [(offsets, keys)]:
            if part_offsets or part_keys:
                table = self._in_chunks(part_offsets, part_keys)
                labels = [Label("diagonal", shift) for shift in part_offsets] + [Label("column", k) for k in part_keys]
                self.tables.update({label: (table, column) for column, label in enumerate(labels)})

    def _in_chunks(self, offsets: tuple[int, ...], keys: tuple[int, ...]) -> Tensor:
        """(b, hq, n, len(offsets) + len(keys)): the weights on keys i + offset and on `keys`, config.diagonal_rows
        rows at a time, or by the backend's own kernel (`FusedStatistics.tables`)."""
        if self.statistics.tables is not None:
            return self.statistics.tables(self.statistics, offsets, keys)
        b, hq, n, kv = self.shape
        step = self.config.diagonal_rows
        chunks = [(start, min(n, start + step)) for start in range(0, n, step)]
        if len(chunks) == 1:
            return self._chunk_weights(offsets, keys, 0, n)
        weights = self.lse.new_empty(b, hq, n, len(offsets) + len(keys))
        for start, stop in chunks:
            weights[:, :, start:stop] = self._chunk_weights(offsets, keys, start, stop)
        return weights

    def _chunk_weights(self, offsets: tuple[int, ...], keys: tuple[int, ...], start: int, stop: int) -> Tensor:
        """The weights of queries start .. stop: gathered keys when there are offsets, else one matmul."""
        if offsets or len(keys) <= self.config.gathered_columns:
            return self._keys_weights(_gathered_keys(self.shape[0], self.shape[2], self.shape[3], self.key.shape[1],
                                                     offsets, keys, start, stop, self.causal, self.key.device),
                                      start, stop)
        return self._columns_weights(_long_on(keys, self.key.device), start, stop)

    def _columns_weights(self, keys: Tensor, start: int, stop: int) -> Tensor:
        """(b, hq, stop - start, len(keys)): queries start .. stop on the same keys, one matmul."""
        b, hq, n, kv = self.shape
        key = float32_copy(self.key[:, :, keys]).repeat_interleave(hq // self.key.shape[1], dim=1)  # (b, hq, c, d)
        logits = torch.matmul(float32_copy(self.query[:, :, start:stop]), key.transpose(-1, -2)) * self.scaling
        rows = torch.arange(start, stop, device=keys.device)
        return self._finish(logits, rows, keys, self.lse[:, :, start:stop])

    def _keys_weights(self, gathered: GatheredKeys, start: int, stop: int) -> Tensor:
        """(b, hq, stop - start, k): queries start .. stop on their gathered keys, one batched matmul."""
        b, hq, n, kv = self.shape
        hk, d, m, k = self.key.shape[1], self.query.shape[-1], stop - start, gathered.inside.shape[1]
        keys = float32_copy(_flat(self.key).index_select(0, gathered.index).view(b * m * hk, k, d))
        # a view where the query arrives float32 (no copy), else its chunk made float32
        query = float32_copy(self.query[:, :, start:stop].transpose(1, 2).reshape(b * m * hk, hq // hk, d))
        logits = torch.bmm(query, keys.transpose(1, 2)).view(b, m, hq, k).transpose(1, 2)  # (b, hq, m, k)
        logits = logits.mul_(self.scaling).float()  # ours: changed in place from here
        if self.dense_bias is not None:
            bias = self.dense_bias[..., start:stop, :] if self.dense_bias.shape[-2] > 1 else self.dense_bias
            logits += bias.expand(*bias.shape[:2], m, kv).gather(-1, gathered.inside.expand(*bias.shape[:2], -1, -1))
        if gathered.hidden is not None:
            logits.masked_fill_(gathered.hidden, float("-inf"))
        return logits.sub_(self.lse[:, :, start:stop, None]).exp_()

    def band(self, low: int, high: int, first: int = 0) -> Iterator[tuple[int, Tensor]]:
        """Chunks of query rows from `first` on: (start, weights (b, hq, rows, high - low + 1)), column c holding
        A[i, i + low + c]. One batched matmul per chunk, the band cut out by a strided view."""
        width, n = high - low + 1, self.shape[2]
        block = self.config.band_block if width > self.config.band_block else 16  # keys per row: block + width - 1
        rows = max(block, self.config.band_rows // max(self.shape[0] * self.shape[1] * (block + width), 1)
                   // block * block)
        for start in range(first, n, rows):
            stop = min(start + rows, n)
            yield start, self._band_weights(self._band_logits(start, stop, low, width, block), start, stop, low)

    def _band_logits(self, start: int, stop: int, low: int, width: int, block: int) -> Tensor:
        """(b, hq, stop - start, width) scaled logits of the band."""
        b, hq, _, d = self.query.shape
        hk, rep = self.key.shape[1], hq // self.key.shape[1]
        blocks = -(-(stop - start) // block)
        query = F.pad(float32_copy(self.query[:, :, start:stop]), (0, 0, 0, blocks * block - (stop - start)))
        query = query.view(b, hk, rep, blocks, block, d).transpose(2, 3).reshape(b, hk, blocks, rep * block, d)
        first_key = start + low  # the first block's first key; keys outside 0 .. kv are zero padding
        span = blocks * block + width - 1
        left, right = max(0, -first_key), max(0, first_key + span - self.key.shape[2])
        keys = F.pad(float32_copy(self.key[:, :, max(0, first_key):first_key + span]), (0, 0, left, right))
        windows = keys.unfold(2, block + width - 1, block)  # (b, hk, blocks, d, block + width - 1), a view
        logits = torch.matmul(query, windows)  # (b, hk, blocks, rep * block, block + width - 1)
        s = logits.stride()  # row r of a block: columns r .. r + width - 1 of its window
        band = logits.as_strided((b, hk, blocks, rep, block, width),
                                 (s[0], s[1], s[2], block * s[3], s[3] + s[4], s[4]))
        out = torch.empty(b, hk, rep, blocks, block, width, dtype=torch.float32, device=logits.device)
        torch.mul(band, self.scaling, out=out.transpose(2, 3))
        return out.view(b, hq, blocks * block, width)[:, :, :stop - start]

    def _band_weights(self, logits: Tensor, start: int, stop: int, low: int) -> Tensor:
        """Band logits (float32, ours to change) -> weights, hidden keys 0 (masks only for chunks that have such)."""
        kv, width = self.shape[3], logits.shape[-1]
        device = logits.device
        keys = torch.arange(start, stop, device=device)[:, None] + low + torch.arange(width, device=device)
        if self.dense_bias is not None:
            bias = self.dense_bias[..., start:stop, :] if self.dense_bias.shape[-2] > 1 else self.dense_bias
            index = keys.clamp(0, kv - 1).expand(*bias.shape[:2], stop - start, width)
            logits += bias.expand(*bias.shape[:2], stop - start, kv).gather(-1, index)
        logits = logits.sub_(self.lse[:, :, start:stop, None]).exp_()
        causal = self.causal and stop - 1 + low + width - 1 > stop - 1 + kv - self.shape[2]
        if start + low < 0 or stop + low + width - 1 > kv or causal:
            hidden = (keys < 0) | (keys >= kv)
            if self.causal:
                hidden |= keys > torch.arange(start, stop, device=keys.device)[:, None] + kv - self.shape[2]
            logits.masked_fill_(hidden, 0.0)
        return logits

    def band_of_rows(self, found: Tensor, low: int, high: int) -> Tensor:
        """(k, high - low + 1): A[i, i + low + c] of the (b, h, i) rows `found` (k, 3), one batched matmul a chunk."""
        b, hq, n, kv = self.shape
        width, hk = high - low + 1, self.key.shape[1]
        out = []
        for part in found.split(self.config.gathered_rows):
            sequence, head, row = part.unbind(1)
            keys = row[:, None] + low + torch.arange(width, device=part.device)  # (k, width)
            inside = keys.clamp(0, kv - 1)
            query = float32_copy(_flat(self.query).index_select(0, (sequence * n + row) * hq + head))  # (k, d)
            index = (sequence[:, None] * kv + inside) * hk + (head // (hq // hk))[:, None]
            gathered = float32_copy(_flat(self.key).index_select(0, index.reshape(-1)).view(len(part), width, -1))
            logits = torch.bmm(gathered, query[:, :, None])[..., 0] * self.scaling
            hidden = (keys < 0) | (keys >= kv)
            if self.dense_bias is not None:
                bias = self.dense_bias
                logits = logits + bias[sequence[:, None] if bias.shape[0] > 1 else 0,
                                       head[:, None] if bias.shape[1] > 1 else 0,
                                       row[:, None] if bias.shape[2] > 1 else 0, inside]
            elif self.causal:
                hidden |= keys > row[:, None] + kv - n
            weights = torch.exp(logits.float() - self.lse[sequence, head, row][:, None])
            out.append(weights.masked_fill_(hidden, 0.0))
        return torch.cat(out) if out else self.lse.new_zeros(0, width)

    def rows(self, rows: Tensor) -> Tensor:
        """(b, hq, len(rows), kv): the query rows' weights over every key, exact (for row maxima)."""
        b, hq, _, kv = self.shape
        keys = torch.arange(kv, device=self.query.device)
        hk = self.key.shape[1]
        query = float32_copy(self.query[:, :, rows]).reshape(b, hk, hq // hk * len(rows), self.query.shape[-1])
        logits = torch.matmul(query, float32_copy(self.key).transpose(-1, -2))  # query heads by key/value head
        logits = logits.view(b, hq, len(rows), kv) * self.scaling
        return self._finish(logits, rows, keys, self.lse[:, :, rows])

    def row_tops(self, rows: Tensor) -> Tensor:
        """(b, hq, len(rows)) long: each query row's argmax, the kernel's `top_keys` where it wrote them."""
        if self.statistics.top_keys is not None:
            return self.statistics.top_keys[:, :, rows].long()
        return self.rows(rows).argmax(dim=-1)

    def _head_keys(self, sequence: int, kv_head: int) -> Tensor:
        """(kv, d): one key/value head's keys, contiguous (a matmul reads a copy ~1.4x faster), once per call."""
        if (sequence, kv_head) not in self.memo:
            self.memo[sequence, kv_head] = float32_copy(self.key[sequence, kv_head]).contiguous()
        return self.memo[sequence, kv_head]

    def tops_of_rows(self, found: Tensor, keys: Tensor, tops: Callable[..., Tensor] | None = None) -> Tensor:
        """(k,) bool: `tops` for the (b, h, query) rows `found` (k, 3). Where every (sequence, key/value head) group,
        padded, fits in config.rows_at_once logits, one batched matmul serves them all; else one group at a time."""
        top_keys = self.statistics.top_keys
        if top_keys is not None:  # the kernel's own argmax: a gather, no logits and no host round-trip
            return top_keys[found[:, 0], found[:, 1], found[:, 2]] == keys
        b, hq, _, kv = self.shape
        hk = self.key.shape[1]
        owner = found[:, 0] * hk + found[:, 1] // (hq // hk)
        sizes = torch.bincount(owner, minlength=b * hk)
        if b * hk * int(sizes.max()) * kv > self.config.rows_at_once:
            read = tops or self.tops
            return by_owner(owner, lambda part, key: (
                read(int(part[0, 0]), int(part[0, 1]) // (hq // hk), part[:, 1], part[:, 2], key),), found, keys)[0]
        owner, order = owner.sort(stable=True)
        top = self._tops_padded(found[order], keys[order], owner, sizes)
        return torch.empty_like(top).index_copy_(0, order, top)  # back to the order asked for

    def neighbour_hits(self, selected: Tensor, shift: int) -> Tensor:
        """(hq,) float64: per query head, how many selected queries i ((b, n) bool) have their argmax at i + shift
        (the earliest maximum wins, a NaN counts as the maximum), from `top_keys`, else `search`, else whole rows."""
        search = self.statistics.search
        if self.statistics.top_keys is None and search is not None:
            return search.neighbour_hits(self, selected, shift).to(self.lse.device)
        return self.counted_hits(selected, shift).to(self.lse.device)

    def neighbour_reads(self, shifts: Iterable[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(diagonal offsets, key columns) neighbour_hits reads for these shifts (`RowSearch.reads`; none where top
        keys or whole rows answer), so that `prefetch` computes them in the layer's one pass."""
        search = self.statistics.search
        if self.statistics.top_keys is not None or search is None:
            return (), ()
        return search.reads(self.statistics, tuple(shifts))

    def counted_hits(self, selected: Tensor, shift: int) -> Tensor:
        """neighbour_hits without a search: from the top keys (no sync) or whole rows."""
        b, hq, n, _ = self.shape
        top_keys = self.statistics.top_keys
        if top_keys is not None:  # the kernel's argmax per row: counted on the device (no sync), float64 there
            hit = (top_keys == _neighbours(n, shift, top_keys.device)) & selected.to(top_keys.device)[:, None, :n]
            return hit.sum(dim=(0, 2), dtype=torch.float64)
        found = selected.to(self.lse.device)[:, None, :n].expand(b, hq, n).nonzero()  # (k, 3): b, h, query
        top = self.tops_of_rows(found, found[:, 2] + shift) if len(found) else found.new_zeros(0, dtype=torch.bool)
        return torch.bincount(found[top, 1].cpu(), minlength=hq).double()

    def _tops_padded(self, found: Tensor, keys: Tensor, owner: Tensor, sizes: Tensor) -> Tensor:
        """tops_of_rows for rows sorted by owner (sequence x hk + key/value head), padded to (b x hk, most rows)."""
        b, hq, n, kv = self.shape
        hk, d = self.key.shape[1], self.query.shape[-1]
        slot = torch.arange(len(found), device=found.device) - (torch.cumsum(sizes, 0) - sizes)[owner]
        padded = found.new_zeros(b * hk, int(sizes.max()), 3)  # padding: sequence 0, head 0, query 0
        padded[owner, slot] = found
        sequence, head, row = padded.unbind(-1)
        query = float32_copy(_flat(self.query).index_select(0, ((sequence * n + row) * hq + head).reshape(-1)))
        limit = min(kv, int(found[:, 2].max()) + kv - n + 1) if self.causal else kv
        seen = float32_copy(self.key[:, :, :limit].reshape(b * hk, limit, d))  # the keys a row may see
        logits = torch.bmm(query.view(b * hk, -1, d) * self.scaling, seen.transpose(1, 2))  # (b x hk, most, keys)
        if self.dense_bias is not None:
            bias = self.dense_bias[..., :limit]
            logits += bias[sequence if bias.shape[0] > 1 else 0, head if bias.shape[1] > 1 else 0,
                           row if bias.shape[2] > 1 else 0]
        elif self.causal:
            logits.masked_fill_(torch.arange(limit, device=row.device) > row[..., None] + kv - n, float("-inf"))
        return _key_is_top(logits[owner, slot], keys)  # the real rows only

    def tops(self, batch: int, kv_head: int, heads: Tensor, rows: Tensor, keys: Tensor) -> Tensor:
        """(len(rows),) bool: whether keys[t] is the argmax of row (heads[t], rows[t]) of one sequence's key/value head
        `kv_head`, from the float32 logits of whole rows (exp is monotonic)."""
        return self._in_row_chunks(self._tops_chunk, batch, kv_head, heads, rows, keys)[0]

    def _in_row_chunks(self, read: Callable[..., tuple[Tensor, ...]], batch: int, kv_head: int,
                       heads: Tensor, rows: Tensor, keys: Tensor) -> tuple[Tensor, ...]:
        """read(batch, kv_head, heads, rows, keys) in chunks of config.row_logits logits (rows sorted first: a causal
        chunk computes only the keys up to its last query), its outputs in the order asked for."""
        chunk = max(self.config.row_chunk, self.config.row_logits // self.shape[3])
        if len(rows) <= chunk:
            return read(batch, kv_head, heads, rows, keys)
        rows, order = rows.sort()
        heads, keys = heads[order], keys[order]
        parts = [read(batch, kv_head, heads[first:first + chunk], rows[first:first + chunk], keys[first:first + chunk])
                 for first in range(0, len(rows), chunk)]
        return tuple(column[0].new_empty(len(rows)).index_copy_(0, order, torch.cat(column))
                     for column in zip(*parts))  # back to the order asked for

    def _tops_chunk(self, batch: int, kv_head: int, heads: Tensor, rows: Tensor, keys: Tensor) -> tuple[Tensor]:
        """tops() of one chunk, from float32 logits."""
        return (_key_is_top(self._row_logits(batch, kv_head, heads, rows), keys),)

    def _row_logits(self, batch: int, kv_head: int, heads: Tensor, rows: Tensor, low: int = 0) -> Tensor:
        """(len(rows), keys low .. the last row's) scaled logits of one sequence's key/value head, masked at -inf."""
        kv, offset = self.shape[3], self.shape[3] - self.shape[2]
        limit = min(kv, int(rows.max()) + offset + 1) if self.causal else kv
        keys = self._head_keys(batch, kv_head)[low:limit]
        logits = (float32_copy(self.query[batch, heads, rows]) * self.scaling) @ keys.T  # scaled as blocked
        if self.dense_bias is not None:
            bias = self.dense_bias[batch if self.dense_bias.shape[0] > 1 else 0][..., low:limit]  # (hq or 1, n or 1, k)
            logits += bias[heads if bias.shape[0] > 1 else 0, rows if bias.shape[1] > 1 else 0]
        elif self.causal:
            seen = int(rows.min()) + offset + 1 - low  # columns every row sees
            hidden = torch.arange(low + seen, limit, device=logits.device)[None, :] > rows[:, None] + offset
            logits[:, seen:].masked_fill_(hidden, float("-inf"))
        return logits


def side_by_side(calls: list[FusedStatistics]) -> FusedStatistics:
    """Several layer calls' statistics as one record, their heads side by side: query head l x hq + h is head h of
    calls[l]. A score then pays its small operations once per group of layers. The calls share backend, shape,
    scaling, causal flag and no other mask (`plain`); top keys are kept, row maxima are not."""
    first = calls[0]
    assert all(call.backend == first.backend and call.shape == first.shape and call.plain
               and call.causal == first.causal and call.scaling == first.scaling and call.config == first.config
               for call in calls), "side_by_side takes calls of one backend, shape and config, no mask but causal"

    def heads(tensors: list[Tensor]) -> Tensor:
        return torch.cat([tensor.transpose(1, 2) for tensor in tensors], dim=2).transpose(1, 2)

    tops = [call.top_keys for call in calls if call.top_keys is not None]  # a kernel's top keys, kept with its heads
    return replace(first, query=heads([call.query for call in calls]), key=heads([call.key for call in calls]),
                   lse=torch.cat([call.lse for call in calls], dim=1), row_maxima=None,
                   top_keys=torch.cat(tops, dim=1) if len(tops) == len(calls) else None)


@dataclass(frozen=True)
class GatheredKeys:
    """Which keys each query row of a chunk reads (one set per row, shared by its heads), and where they are."""

    inside: Tensor  # (m, k) long: the keys, clamped to existing ones
    hidden: Tensor | None  # (m, k) bool: keys that do not exist or are causally hidden (None: none is)
    index: Tensor  # (b x m x hk x k,) long: the rows of _flat(key) to gather, in (b, m, hk, k) order


@functools.lru_cache(maxsize=64)
def _gathered_keys(b: int, n: int, kv: int, hk: int, offsets: tuple[int, ...], keys: tuple[int, ...], start: int,
                   stop: int, causal: bool, device: torch.device) -> GatheredKeys:
    """The keys i + offset and `keys` of queries start .. stop in the flat key rows: kept for every layer."""
    rows = torch.arange(start, stop, device=device)
    wanted = torch.cat([rows[:, None] + _long_on(offsets, device), _long_on(keys, device).expand(len(rows), -1)],
                       dim=1)  # (m, k)
    hidden = (wanted < 0) | (wanted >= kv)
    if causal:
        hidden |= wanted > rows[:, None] + kv - n
    inside = wanted.clamp(0, kv - 1)
    index = (torch.arange(b, device=device)[:, None, None, None] * kv + inside[None, :, None, :]) * hk + \
        torch.arange(hk, device=device)[None, None, :, None]  # (b, m, hk, k)
    return GatheredKeys(inside, hidden if _any_hidden(n, kv, offsets, keys, start, stop, causal) else None,
                        index.reshape(-1))


def _any_hidden(n: int, kv: int, offsets: tuple[int, ...], keys: tuple[int, ...], start: int, stop: int,
                causal: bool) -> bool:
    """Whether any key of queries start .. stop is missing or causally hidden, from the integers (no GPU wait)."""
    if start >= stop or not offsets + keys:
        return False
    low = min([start + offset for offset in offsets] + list(keys))
    high = max([stop - 1 + offset for offset in offsets] + list(keys))
    if low < 0 or high >= kv:
        return True
    # causal: an offset past kv - n hides a key of every row, a fixed key one of the first row
    return causal and (any(offset > kv - n for offset in offsets) or any(key > start + kv - n for key in keys))


@functools.lru_cache(maxsize=64)
def _neighbours(n: int, shift: int, device: torch.device) -> Tensor:
    """(n,) long: each query's neighbour key i + shift, made once for every layer of every forward."""
    return torch.arange(shift, n + shift, device=device)


def uploaded(tensor: Tensor, device: torch.device) -> Tensor:
    """`tensor` on `device`, a host tensor copied without waiting (a blocking copy would sync a forward's stream)."""
    return tensor.to(device, non_blocking=tensor.device.type == "cpu")


def _long_on(values: tuple[int, ...], device: torch.device) -> Tensor:
    """The integers as a long tensor on `device`: consecutive ones made there (arange), others `uploaded`."""
    if values and list(values) == list(range(values[0], values[0] + len(values))):
        return torch.arange(values[0], values[0] + len(values), device=device)
    return uploaded(torch.tensor(values, dtype=torch.long), device)


def by_owner(owner: Tensor, read: Callable[..., tuple[Tensor, ...]], *columns: Tensor) -> tuple[Tensor, ...]:
    """read(*columns of one owner's rows) for each owner, its outputs back in the order of the rows."""
    owner, order = owner.sort(stable=True)
    counts = torch.unique_consecutive(owner, return_counts=True)[1].tolist()
    parts = [read(*part) for part in zip(*(column[order].split(counts) for column in columns))]
    return tuple(torch.empty_like(out).index_copy_(0, order, out)
                 for out in (torch.cat(column) for column in zip(*parts)))

def _key_is_top(logits: Tensor, keys: Tensor) -> Tensor:
    """(k,) bool: whether keys[t] is the argmax of row t of `logits` (k, keys): against the amax of the others (much
    cheaper than argmax on CPU), ties and NaNs to argmax. `logits` is changed and put back."""
    rows = torch.arange(len(keys), device=keys.device)
    own = logits[rows, keys]
    logits[rows, keys] = float("-inf")
    others = logits.amax(dim=-1)
    top = own > others
    unsure = (own == others) | own.isnan() | others.isnan()
    if bool(unsure.any()):
        logits[rows, keys] = own
        top[unsure] = logits[unsure].argmax(dim=-1) == keys[unsure]
    return top


def _flat(heads: Tensor) -> Tensor:
    """(b, h, n, d) -> (b x n x h, d): a view in the layout transformers hands them over in, else one copy."""
    return heads.transpose(1, 2).reshape(-1, heads.shape[-1])

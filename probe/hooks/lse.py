"""Fused attention that also returns each query row's log-sum-exp, and single weights rebuilt from it.

A weight is `A[i, j] = exp(q_i . k_j * scale + bias_ij - lse_i)`: with `lse` from the fused kernel (which computes
it anyway, at the cost of a plain sdpa forward), any diagonal, column or band of A costs O(n x head_dim) per key
offset and head, and no score needs the n x n matrix. The layer's output is the fused kernel's, exact.

`lse_problem` says where a layer's logits cannot be rebuilt exactly this way (soft-capping, learned sinks, dropout,
a device without a wired kernel); the hooks then run the blocked eager path (probe.hooks.blocked) instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

ROW_CHUNK = 128  # query rows whose logits are computed whole at once (exact row maxima), at least
ROWS_AT_ONCE = 2**21  # logits of the padded rows of every key/value head at once, at most (else one head at a time)
ROW_LOGITS = 2**20  # logits of whole rows computed at once, at most (ROW_CHUNK rows beyond that)
BAND_BLOCK = 64  # query rows per block of a band: each block computes BAND_BLOCK + width - 1 keys
BAND_ROWS = 64 * 2**20 // 4  # logits of a band chunk (batch x heads x rows x keys), in floats
DIAGONAL_ROWS = 4096  # query rows whose diagonals' keys are gathered at once (keys x shifts x rows x head_dim)
GATHERED_COLUMNS = 4  # columns computed with the diagonals' gather; more go through one matmul
NEAR_SPAN = 1024  # query positions of one bucket of the near-keys stage: its rows share one slice of keys
NEAR_BEFORE = 1024  # keys before a bucket that its slice includes
GATHERED_ROWS = 2048  # rows of a gathered band at once (their keys: rows x width x head_dim floats)
BOUND = 2.0**-7  # bfloat16 upper bounds of logits: q . k + BOUND |q| |k| (the roundings need at most 0.0059 |q| |k|)
BOUNDS_ON_CPU = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()  # bfloat16 matmuls ~3x faster
CANDIDATES = 64  # keys a bounded row may have whose bound reaches its key's logit: their float32 logits decide it
BOUNDS_FROM = 16384  # keys from which whole rows are bounded first (measured: 2.5x faster at 32768 keys; at 8192 the
# operations around the matmul cost what it saves)

Label = tuple[str, int]
"""("diagonal", shift): A[i, i + shift] for every query i; ("column", key): A[i, key]."""


def lse_problem(query: Tensor, key: Tensor, mask: Tensor | None, *, causal: bool, softcap: float | None,
                sinks: Tensor | None, dropout: float) -> str:
    """Why this call's weights cannot be rebuilt from a fused kernel's log-sum-exp ("" where they can)."""
    if softcap is not None:
        return "soft-capped logits (the fused kernel has no soft-capping)"
    if sinks is not None:
        return "learned sink logits"
    if dropout > 0.0:
        return "dropout while training"
    if query.device.type != "cpu":
        return f"no log-sum-exp kernel wired for {query.device.type} yet (CPU only; untested without a GPU)"
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad):
        return "gradients requested"
    if causal and mask is None and query.shape[2] != key.shape[2]:
        return "causal queries after a key/value prefix"
    if query.shape[1] % key.shape[1]:
        return "query heads not a multiple of key/value heads"
    return ""


def additive_bias(mask: Tensor | None, position_bias: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """The mask (boolean: True = attend, or additive) and position bias as one additive float tensor, or None."""
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask.logical_not(),
                                                                                   float("-inf"))
    elif mask is not None:
        mask = mask.to(dtype)
    if position_bias is None:
        return mask
    position_bias = position_bias.to(dtype)
    return position_bias if mask is None else mask + position_bias


@dataclass
class FusedAttention:
    """One layer call's queries, keys, additive bias and log-sum-exp: what any weight A[i, j] is rebuilt from."""

    query: Tensor  # (b, hq, n, d)
    key: Tensor  # (b, hk, kv, d)
    bias: Tensor | None  # additive, broadcastable to (b, hq, n, kv); None: plain (causal or not)
    scaling: float
    causal: bool  # keys after the query (j > i + kv - n) get weight 0; only where bias is None
    lse: Tensor  # (b, hq, n) float32
    tables: dict[Label, tuple[Tensor, int]] = field(default_factory=dict, repr=False)  # label -> (table, column)
    head_keys: dict[tuple, Tensor] = field(default_factory=dict, repr=False)  # per (sequence, kv head, ...): cache

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(batch, query heads, queries, keys)."""
        return self.query.shape[0], self.query.shape[1], self.query.shape[2], self.key.shape[2]

    def _grouped(self, query: Tensor) -> Tensor:
        """(b, hq, m, d) -> (b, hk, rep * m, d): the query heads of one key/value head one after another."""
        b, hq, m, d = query.shape
        return query.reshape(b, self.key.shape[1], (hq // self.key.shape[1]) * m, d)

    def _finish(self, logits: Tensor, rows: Tensor | slice, keys: Tensor, lse: Tensor) -> Tensor:
        """logits (b, hq, m, k) of query rows and keys -> weights: bias added, causal keys zeroed."""
        if self.bias is not None:
            bias = self.bias[..., rows, :] if self.bias.shape[-2] > 1 else self.bias
            logits = logits + bias[..., keys]
        elif self.causal:
            positions = torch.arange(self.shape[2], device=logits.device)[rows] + self.shape[3] - self.shape[2]
            logits = logits.masked_fill(keys[None, :] > positions[:, None], float("-inf"))
        return torch.exp(logits.float() - lse[..., None])

    def diagonal(self, shift: int) -> tuple[int, Tensor]:
        """(first query i, weights (b, hq, m)) of A[i, i + shift] for every query whose key exists."""
        n, kv = self.shape[2], self.shape[3]
        first, last = max(0, -shift), max(max(0, -shift), min(n, kv - shift))
        return first, self.aligned(shift)[..., first:last]

    def aligned(self, shift: int) -> Tensor:
        """(b, hq, n): A[i, i + shift] for every query i, exactly 0 where the key does not exist or is hidden (kept:
        several scores read the same diagonal; `prefetch` computes several at once)."""
        return self.stacked([("diagonal", shift)])[..., 0]

    def column(self, key: int) -> Tensor:
        """(b, hq, n): A[i, key] for every query i (kept: the sink and positional scores both read key 0)."""
        return self.stacked([("column", key)])[..., 0]

    def stacked(self, labels: list[Label]) -> Tensor:
        """(b, hq, n, len(labels)): the diagonals ("diagonal", shift) and columns ("column", key) named, computed by
        `prefetch` where they are not yet: a view of the table where one prefetch made them side by side, in order."""
        table, columns = self.covering(labels)
        return table if columns == list(range(table.shape[-1])) else table[..., columns]

    def covering(self, labels: list[Label]) -> tuple[Tensor, list[int]]:
        """(table (b, hq, n, w), the column of each label in it): a view of the columns of one prefetched table from
        the first label's to the last's (no copy), else the labels stacked (computed by `prefetch` where needed)."""
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
        """Compute the diagonals A[i, i + shift] and the columns A[i, key] that the scores will read in one table
        (b, hq, n, k), in one pass over the queries (their keys gathered per chunk of rows, one batched matmul; many
        columns, a wide sink, through one matmul against them), so that scores reading the same or several pay
        once, not once each. Keys that do not exist (columns past the last key: not computed) or are hidden weigh
        exactly 0."""
        kv = self.shape[3]
        offsets = tuple(sorted({int(shift) for shift in shifts} - {shift for kind, shift in self.tables
                                                                     if kind == "diagonal"}))
        keys = tuple(sorted({int(key) for key in columns if 0 <= key < kv} - {key for kind, key in self.tables
                                                                             if kind == "column"}))
        wide = len(keys) > GATHERED_COLUMNS  # a wide sink: one matmul against the columns, not a gather
        if offsets or (keys and not wide):
            self._keep([("diagonal", shift) for shift in offsets] + [("column", key) for key in keys if not wide],
                       self._in_chunks(offsets, () if wide else keys))
        if wide:
            self._keep([("column", key) for key in keys], self._in_chunks((), keys))

    def _keep(self, labels: list[Label], table: Tensor) -> None:
        for column, label in enumerate(labels):
            self.tables[label] = table, column

    def _in_chunks(self, offsets: tuple[int, ...], keys: tuple[int, ...]) -> Tensor:
        """(b, hq, n, len(offsets) + len(keys)): the weights of every query i on keys i + offset and on `keys`, a
        chunk of DIAGONAL_ROWS rows at a time (one chunk: returned as computed, no copy)."""
        b, hq, n, kv = self.shape
        chunks = [(start, min(n, start + DIAGONAL_ROWS)) for start in range(0, n, DIAGONAL_ROWS)]
        if len(chunks) == 1:
            return self._chunk_weights(offsets, keys, 0, n)
        weights = self.lse.new_empty(b, hq, n, len(offsets) + len(keys))
        for start, stop in chunks:
            weights[:, :, start:stop] = self._chunk_weights(offsets, keys, start, stop)
        return weights

    def _chunk_weights(self, offsets: tuple[int, ...], keys: tuple[int, ...], start: int, stop: int) -> Tensor:
        """The weights of queries start .. stop: gathered keys when there are offsets, else one matmul."""
        if offsets or len(keys) <= GATHERED_COLUMNS:
            return self._keys_weights(_gathered_keys(self.shape[0], self.shape[2], self.shape[3], self.key.shape[1],
                                                     offsets, keys, start, stop, self.causal, self.key.device),
                                      start, stop)
        return self._columns_weights(torch.tensor(keys, device=self.key.device), start, stop)

    def _columns_weights(self, keys: Tensor, start: int, stop: int) -> Tensor:
        """(b, hq, stop - start, len(keys)): the weights of queries start .. stop on the same keys, one matmul of
        the queries against those keys (repeated to the query heads: a few rows)."""
        b, hq, n, kv = self.shape
        key = self.key[:, :, keys].repeat_interleave(hq // self.key.shape[1], dim=1)  # (b, hq, c, d)
        logits = torch.matmul(self.query[:, :, start:stop], key.transpose(-1, -2)) * self.scaling
        rows = torch.arange(start, stop, device=keys.device)
        return self._finish(logits, rows, keys, self.lse[:, :, start:stop])

    def _keys_weights(self, gathered: "GatheredKeys", start: int, stop: int) -> Tensor:
        """(b, hq, stop - start, k): the weights of queries start .. stop on their keys (one set per query, shared
        by its heads), gathered from the flat key rows: one batched matmul; hidden keys exactly 0."""
        b, hq, n, kv = self.shape
        hk, d, m, k = self.key.shape[1], self.query.shape[-1], stop - start, gathered.inside.shape[1]
        keys = _flat(self.key).index_select(0, gathered.index).view(b * m * hk, k, d)
        query = self.query[:, :, start:stop].transpose(1, 2).reshape(b * m * hk, hq // hk, d)  # a view, as handed over
        logits = torch.bmm(query, keys.transpose(1, 2)).view(b, m, hq, k).transpose(1, 2)  # (b, hq, m, k)
        logits = logits.mul_(self.scaling).float()  # ours: changed in place from here
        if self.bias is not None:
            bias = self.bias[..., start:stop, :] if self.bias.shape[-2] > 1 else self.bias
            logits += bias.expand(*bias.shape[:2], m, kv).gather(-1, gathered.inside.expand(*bias.shape[:2], -1, -1))
        if gathered.hidden is not None:
            logits.masked_fill_(gathered.hidden, float("-inf"))
        return logits.sub_(self.lse[:, :, start:stop, None]).exp_()

    def band(self, low: int, high: int, first: int = 0) -> Iterator[tuple[int, Tensor]]:
        """Chunks of query rows from `first` on: (start, weights (b, hq, rows, high - low + 1)), column c holding
        A[i, i + low + c] (0 where that key does not exist or is masked). One batched matmul per chunk: query blocks
        against the keys their band spans, the band cut out of it by a strided view."""
        width, n = high - low + 1, self.shape[2]
        block = BAND_BLOCK if width > BAND_BLOCK else 16  # keys computed per row: block + width - 1
        rows = max(block, BAND_ROWS // max(self.shape[0] * self.shape[1] * (block + width), 1) // block * block)
        for start in range(first, n, rows):
            stop = min(start + rows, n)
            yield start, self._band_weights(self._band_logits(start, stop, low, width, block), start, stop, low)

    def _band_logits(self, start: int, stop: int, low: int, width: int, block: int) -> Tensor:
        """(b, hq, stop - start, width) scaled logits of the band, through one batched matmul, and the band cut out,
        scaled and put in head order in one pass."""
        b, hq, _, d = self.query.shape
        hk, rep = self.key.shape[1], hq // self.key.shape[1]
        blocks = -(-(stop - start) // block)
        query = F.pad(self.query[:, :, start:stop], (0, 0, 0, blocks * block - (stop - start)))
        query = query.view(b, hk, rep, blocks, block, d).transpose(2, 3).reshape(b, hk, blocks, rep * block, d)
        first_key = start + low  # the first block's first key; keys outside 0 .. kv are zero padding
        span = blocks * block + width - 1
        left, right = max(0, -first_key), max(0, first_key + span - self.key.shape[2])
        keys = F.pad(self.key[:, :, max(0, first_key):first_key + span], (0, 0, left, right))
        windows = keys.unfold(2, block + width - 1, block)  # (b, hk, blocks, d, block + width - 1), a view
        logits = torch.matmul(query, windows)  # (b, hk, blocks, rep * block, block + width - 1)
        s = logits.stride()  # row r of a block: columns r .. r + width - 1 of its window
        band = logits.as_strided((b, hk, blocks, rep, block, width),
                                 (s[0], s[1], s[2], block * s[3], s[3] + s[4], s[4]))
        out = torch.empty(b, hk, rep, blocks, block, width, dtype=torch.float32, device=logits.device)
        torch.mul(band, self.scaling, out=out.transpose(2, 3))
        return out.view(b, hq, blocks * block, width)[:, :, :stop - start]

    def _band_weights(self, logits: Tensor, start: int, stop: int, low: int) -> Tensor:
        """Band logits (float32, ours to change) -> weights: bias gathered, keys that do not exist or are causally
        hidden at weight 0 (masks built only for the chunks that have such keys)."""
        kv, width = self.shape[3], logits.shape[-1]
        keys = torch.arange(start, stop, device=logits.device)[:, None] + low + torch.arange(width, device=logits.device)
        if self.bias is not None:
            bias = self.bias[..., start:stop, :] if self.bias.shape[-2] > 1 else self.bias
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
        """(k, high - low + 1): A[i, i + low + c] of the (b, h, i) rows `found` (k, 3), 0 where that key does not
        exist or is masked; each row's query and keys gathered from the flat rows, one batched matmul per chunk."""
        b, hq, n, kv = self.shape
        width, hk = high - low + 1, self.key.shape[1]
        out = []
        for part in found.split(GATHERED_ROWS):
            sequence, head, row = part.unbind(1)
            keys = row[:, None] + low + torch.arange(width, device=part.device)  # (k, width)
            inside = keys.clamp(0, kv - 1)
            query = _flat(self.query).index_select(0, (sequence * n + row) * hq + head)  # (k, d)
            index = (sequence[:, None] * kv + inside) * hk + (head // (hq // hk))[:, None]
            gathered = _flat(self.key).index_select(0, index.reshape(-1)).view(len(part), width, -1)
            logits = torch.bmm(gathered, query[:, :, None])[..., 0] * self.scaling
            hidden = (keys < 0) | (keys >= kv)
            if self.bias is not None:
                bias = self.bias
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
        logits = torch.matmul(self._grouped(self.query[:, :, rows]), self.key.transpose(-1, -2))
        logits = logits.view(b, hq, len(rows), kv) * self.scaling
        return self._finish(logits, rows, keys, self.lse[:, :, rows])

    def near_of_rows(self, found: Tensor, keys: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(beaten (k,), tied (k,), mass (k,)) for the (b, h, query) rows `found` (k, 3) and one key each, over the
        keys near each row: the rows of a (sequence, key/value head) whose queries
        fall in one bucket of NEAR_SPAN positions share one slice of keys, from NEAR_BEFORE keys before the bucket to
        its last query (so a row sees at least its NEAR_BEFORE keys before it). beaten: a key of the slice has a
        larger logit than keys[t]; tied: none is larger but one equals it (argmax's tie rule needs the whole row);
        mass: the weight of every key of the slice the row may attend to, keys[t]'s included, and of key 0."""
        b, hq, n, kv = self.shape
        hk = self.key.shape[1]
        position = found[:, 2] + kv - n  # each query's own key position
        owner = ((found[:, 0] * hk + found[:, 1] // (hq // hk)) * (kv // NEAR_SPAN + 1)) + position // NEAR_SPAN
        beaten, tied, mass = _by_owner(owner, self._near_part, found, keys, position)
        return beaten, tied, mass

    def _near_part(self, part: Tensor, keys: Tensor, position: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """near_of_rows for the rows of one (sequence, key/value head, bucket)."""
        sequence, kv_head = int(part[0, 0]), int(part[0, 1]) // (self.shape[1] // self.key.shape[1])
        low = max(0, int(position[0]) // NEAR_SPAN * NEAR_SPAN - NEAR_BEFORE)
        high = int(position.max()) + 1 if self.causal else self.shape[3]
        logits = (self.query[sequence, part[:, 1], part[:, 2]] * self.scaling) @ self._head_keys(
            sequence, kv_head)[low:high].T  # (r, high - low)
        if self.bias is not None:
            bias = self.bias[sequence if self.bias.shape[0] > 1 else 0][..., low:high]  # (hq or 1, n or 1, keys)
            logits += bias[part[:, 1] if bias.shape[0] > 1 else 0, part[:, 2] if bias.shape[1] > 1 else 0]
        elif self.causal:
            seen = int(position.min()) + 1 - low  # columns every row of the part may attend to
            columns = torch.arange(low + seen, high, device=logits.device)
            logits[:, seen:].masked_fill_(columns[None, :] > position[:, None], float("-inf"))
        rows = torch.arange(len(part), device=logits.device)
        own = logits[rows, keys - low]
        logits[rows, keys - low] = float("-inf")
        others = logits.amax(dim=-1)
        beaten, tied = others > own, others == own
        mass = torch.zeros_like(own)  # only the rows neither beaten nor tied need it: the others are settled
        weighed = ~beaten & ~tied
        if bool(weighed.any()):  # most rows: the mass of all (in place, no copy), kept for those
            lse = self.lse[sequence, part[:, 1], part[:, 2]]
            mass = logits.sub_(lse[:, None]).exp_().sum(dim=-1) + torch.exp(own - lse)
            if low > 0:  # key 0 (the sink: often most of a row's weight) outside the slice
                mass += self.column(0)[sequence, part[:, 1], part[:, 2]]
            mass = mass.where(weighed, 0.0)
        return beaten, tied, mass

    def beaten_by_witnesses(self, found: Tensor, keys: Tensor, first: int, longest: int) -> Tensor:
        """(k,) bool: whether a likely witness that the (b, h, query) row found[t] may attend to, other than keys[t],
        has a larger logit than keys[t] by more than float32's rounding: keys[t] is then surely not the row's top,
        however the logits are rounded (ties and near-ties: False, left to the whole row). The likely witnesses of a
        key/value head are its `first` keys, where a row's top most often lies far from the row (Xiao et al. 2023,
        "Efficient Streaming Language Models with Attention Sinks"), and its `longest` keys; one matmul per
        (sequence, key/value head)."""
        if not len(found):
            return torch.zeros(0, dtype=torch.bool, device=found.device)
        hq, hk = self.shape[1], self.key.shape[1]
        owner = found[:, 0] * hk + found[:, 1] // (hq // hk)
        return _by_owner(owner, lambda part, key: (self._beaten_part(part, key, first, longest),), found, keys)[0]

    def _witnesses(self, sequence: int, kv_head: int, first: int, longest: int) -> Tensor:
        """The key indices beaten_by_witnesses reads for one key/value head: the first keys, then the longest of the
        others (made once per call)."""
        if (sequence, kv_head, "witnesses", first, longest) not in self.head_keys:
            norms = self._head_keys(sequence, kv_head)[first:].norm(dim=-1)
            longer = norms.topk(min(longest, len(norms))).indices.sort().values + first
            self.head_keys[(sequence, kv_head, "witnesses", first, longest)] = torch.cat(
                [torch.arange(min(first, self.shape[3]), device=longer.device), longer])
        return self.head_keys[(sequence, kv_head, "witnesses", first, longest)]

    def _beaten_part(self, part: Tensor, keys: Tensor, first: int, longest: int) -> Tensor:
        """beaten_by_witnesses for the rows of one (sequence, key/value head)."""
        sequence, kv_head = int(part[0, 0]), int(part[0, 1]) // (self.shape[1] // self.key.shape[1])
        head, row = part[:, 1], part[:, 2]
        head_keys, witnesses = self._head_keys(sequence, kv_head), self._witnesses(sequence, kv_head, first, longest)
        witness_keys = head_keys[witnesses]  # (witnesses, d)
        query = self.query[sequence, head, row] * self.scaling  # (r, d), scaled as the blocked path
        logits = query @ witness_keys.T  # (r, witnesses)
        own = (query * head_keys[keys]).sum(dim=-1)  # (r,)
        if self.bias is not None:
            bias = self.bias[sequence if self.bias.shape[0] > 1 else 0]  # (hq or 1, n or 1, kv)
            bias = bias[head if bias.shape[0] > 1 else 0, row if bias.shape[1] > 1 else 0].expand(len(part), -1)
            logits += bias[:, witnesses]
            own = own + bias.gather(1, keys[:, None])[:, 0]
        elif self.causal:
            logits.masked_fill_(witnesses[None, :] > row[:, None] + self.shape[3] - self.shape[2], float("-inf"))
        longest = torch.maximum(witness_keys.norm(dim=-1).max(), head_keys[keys].norm(dim=-1))
        rounding = 2.0**-13 * (query.norm(dim=-1) * longest + own.abs())  # far above float32's, bias included
        return logits.amax(dim=-1) > own + rounding  # keys[t] among the witnesses: its logit is within rounding

    def _head_keys(self, sequence: int, kv_head: int) -> Tensor:
        """(kv, d): one key/value head's keys, contiguous (they arrive strided: a matmul reads a copy ~1.4x
        faster), made once per layer call."""
        if (sequence, kv_head) not in self.head_keys:
            self.head_keys[(sequence, kv_head)] = self.key[sequence, kv_head].contiguous()
        return self.head_keys[(sequence, kv_head)]

    def tops_of_rows(self, found: Tensor, keys: Tensor) -> Tensor:
        """(k,) bool: `tops` for the (b, h, query) rows `found` (k, 3) of any sequences and heads. Where the rows of
        every (sequence, key/value head) group, padded to the largest group, fit in ROWS_AT_ONCE logits, one batched
        matmul serves them all (short inputs: per-call overhead, not arithmetic, is their cost); else one group at a
        time."""
        b, hq, _, kv = self.shape
        hk = self.key.shape[1]
        owner = found[:, 0] * hk + found[:, 1] // (hq // hk)
        owner, order = owner.sort(stable=True)
        found, keys = found[order], keys[order]
        sizes = torch.bincount(owner, minlength=b * hk)
        if b * hk * int(sizes.max()) * kv > ROWS_AT_ONCE:
            groups = sizes[sizes > 0].tolist()
            top = torch.cat([self.tops(int(part[0, 0]), int(part[0, 1]) // (hq // hk), part[:, 1], part[:, 2], key)
                             for part, key in zip(found.split(groups), keys.split(groups))])
        else:
            top = self._tops_padded(found, keys, owner, sizes)
        return torch.empty_like(top).index_copy_(0, order, top)  # back to the order asked for

    def _tops_padded(self, found: Tensor, keys: Tensor, owner: Tensor, sizes: Tensor) -> Tensor:
        """tops_of_rows for rows sorted by owner (sequence x hk + key/value head), padded to (b x hk, most rows)."""
        b, hq, n, kv = self.shape
        hk, d = self.key.shape[1], self.query.shape[-1]
        slot = torch.arange(len(found), device=found.device) - (torch.cumsum(sizes, 0) - sizes)[owner]
        padded = found.new_zeros(b * hk, int(sizes.max()), 3)  # padding: sequence 0, head 0, query 0
        padded[owner, slot] = found
        sequence, head, row = padded.unbind(-1)
        query = _flat(self.query).index_select(0, ((sequence * n + row) * hq + head).reshape(-1))
        limit = min(kv, int(found[:, 2].max()) + kv - n + 1) if self.causal else kv
        logits = torch.bmm(query.view(b * hk, -1, d) * self.scaling,
                           self.key[:, :, :limit].reshape(b * hk, limit, d).transpose(1, 2))  # (b x hk, most, keys)
        if self.bias is not None:
            bias = self.bias[..., :limit]
            logits += bias[sequence if bias.shape[0] > 1 else 0, head if bias.shape[1] > 1 else 0,
                           row if bias.shape[2] > 1 else 0]
        elif self.causal:
            logits.masked_fill_(torch.arange(limit, device=row.device) > row[..., None] + kv - n, float("-inf"))
        return _key_is_top(logits[owner, slot], keys)  # the real rows only

    def tops(self, batch: int, kv_head: int, heads: Tensor, rows: Tensor, keys: Tensor) -> Tensor:
        """(len(rows),) bool: whether key keys[t] holds the largest weight of the row (query head heads[t], query
        rows[t]) of one sequence whose heads share key/value head `kv_head`, as argmax says (the earliest maximum
        wins, a NaN counts as the maximum); from the logits (exp is monotonic). Plain attention over BOUNDS_FROM
        keys or more on a CPU with bfloat16 arithmetic: bounds first (_bounded_tops), the rows they leave unsure
        from whole float32 rows after (at least ROW_CHUNK of them: a matmul of one row rounds a copy of a key unlike
        the key)."""
        if self.bias is not None or not BOUNDS_ON_CPU or self.query.device.type != "cpu" or \
                self.shape[3] < BOUNDS_FROM:
            return self._in_row_chunks(self._tops_chunk, batch, kv_head, heads, rows, keys)[0]
        top, unsure = self._in_row_chunks(self._bounded_tops, batch, kv_head, heads, rows, keys)
        if bool(unsure.any()):
            index = unsure.nonzero()[:, 0]
            padded = torch.cat([index, index[:1].expand(max(0, ROW_CHUNK - len(index)))])
            top[index] = self._in_row_chunks(self._tops_chunk, batch, kv_head, heads[padded], rows[padded],
                                             keys[padded])[0][:len(index)]
        return top

    def _in_row_chunks(self, read: Callable[..., Tensor | tuple[Tensor, ...]], batch: int, kv_head: int,
                       heads: Tensor, rows: Tensor, keys: Tensor) -> tuple[Tensor, ...]:
        """read(batch, kv_head, heads, rows, keys) of chunks of ROW_LOGITS logits (rows sorted first where there is
        more than one chunk: a plain causal chunk computes only the keys up to its last query), its outputs (one
        per row) in the order asked for."""
        chunk = max(ROW_CHUNK, ROW_LOGITS // self.shape[3])
        if len(rows) <= chunk:
            out = read(batch, kv_head, heads, rows, keys)
            return out if isinstance(out, tuple) else (out,)
        rows, order = rows.sort()
        heads, keys = heads[order], keys[order]
        parts = [read(batch, kv_head, heads[first:first + chunk], rows[first:first + chunk], keys[first:first + chunk])
                 for first in range(0, len(rows), chunk)]
        columns = zip(*parts) if isinstance(parts[0], tuple) else [parts]
        return tuple(column[0].new_empty(len(rows)).index_copy_(0, order, torch.cat(column))
                     for column in columns)  # back to the order asked for

    def _tops_chunk(self, batch: int, kv_head: int, heads: Tensor, rows: Tensor, keys: Tensor) -> Tensor:
        """tops() of one chunk, from float32 logits."""
        return _key_is_top(self._row_logits(batch, kv_head, heads, rows), keys)

    def _bounded_tops(self, batch: int, kv_head: int, heads: Tensor, rows: Tensor, keys: Tensor
                      ) -> tuple[Tensor, Tensor]:
        """(top, unsure) (len(rows),) bool, from upper bounds of the logits of keys 1 .. in one bfloat16 matmul
        (q . k plus BOUND |q| |k| as a 65th dimension: bfloat16 rounds each factor and the sum to 2^-9, so a bound
        exceeds its logit by at least 0.0019 |q| |k| and at most 2 BOUND |q| |k|) and key 0's float32 logit (a sink's
        key is often the longest: it would loosen the bounds of every row). The key is the top when every other
        key's bound, and key 0's logit, is below its float32 logit; it is not when the highest bound less that
        slack, or key 0's logit, beats it by more than float32's rounding. Of the rest, most have a key or two whose
        bound reaches the key's logit (at 32768 tokens, 99% have 6 or fewer): those keys' float32 logits decide
        them the same way (_best_candidate); else unsure (ties, NaN, the neighbour at key 0, more than CANDIDATES
        such keys: the whole float32 row decides)."""
        offset = self.shape[3] - self.shape[2]
        limit = min(self.shape[3], int(rows.max()) + offset + 1) if self.causal else self.shape[3]
        query = self.query[batch, heads, rows] * self.scaling  # (r, d) as _row_logits scales it
        head_keys, (bounded_keys, longest) = self._head_keys(batch, kv_head), self._bounded_keys(batch, kv_head)
        norm = query.norm(dim=-1)
        upper = torch.cat([query, BOUND * norm[:, None]], dim=1).to(torch.bfloat16) @ bounded_keys[1:limit].T
        if self.causal:  # (r, limit - 1): column c is key c + 1
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
        beaten = (highest - 2 * BOUND * norm * longest > above) | (sink > above)
        unsure = (~top & ~beaten & (keys > 0) & ~highest.isnan()).nonzero()[:, 0]  # a NaN bound: the whole row
        if len(unsure):  # most have a key or two whose bound reaches theirs: those keys' float32 logits decide
            best = _best_candidate(upper[unsure], query[unsure], below[unsure], head_keys)
            top[unsure] = (best < below[unsure]) & (sink[unsure] < below[unsure])
            beaten[unsure] = (best > above[unsure]) | (sink[unsure] > above[unsure])
        return top & (keys > 0), ~top & ~beaten | (keys == 0)

    def _bounded_keys(self, batch: int, kv_head: int) -> tuple[Tensor, Tensor]:
        """((kv, d + 1) bfloat16: one key/value head's keys and their norms, the longest key but key 0's norm) for
        _bounded_tops, made once per call."""
        if (batch, kv_head, "bounded") not in self.head_keys:
            keys = self._head_keys(batch, kv_head)
            norms = keys.norm(dim=-1, keepdim=True)
            self.head_keys[(batch, kv_head, "bounded")] = torch.cat([keys, norms], dim=1).to(torch.bfloat16)
            self.head_keys[(batch, kv_head, "longest")] = norms[1:].max() if len(keys) > 1 else norms.new_zeros(())
        return self.head_keys[(batch, kv_head, "bounded")], self.head_keys[(batch, kv_head, "longest")]

    def _row_logits(self, batch: int, kv_head: int, heads: Tensor, rows: Tensor) -> Tensor:
        """(len(rows), keys up to the last row's) scaled logits of whole rows, masked keys at -inf."""
        kv, offset = self.shape[3], self.shape[3] - self.shape[2]
        limit = min(kv, int(rows.max()) + offset + 1) if self.causal else kv
        keys = self._head_keys(batch, kv_head)[:limit]
        logits = (self.query[batch, heads, rows] * self.scaling) @ keys.T  # scaled as blocked
        if self.bias is not None:
            bias = self.bias[batch if self.bias.shape[0] > 1 else 0]  # (hq or 1, n or 1, kv)
            logits += bias[heads if bias.shape[0] > 1 else 0, rows if bias.shape[1] > 1 else 0]
        elif self.causal:
            seen = int(rows.min()) + offset + 1  # keys every row of the chunk sees
            hidden = torch.arange(seen, limit, device=logits.device)[None, :] > rows[:, None] + offset
            logits[:, seen:].masked_fill_(hidden, float("-inf"))
        return logits


def side_by_side(calls: list[FusedAttention]) -> FusedAttention:
    """Several layer calls as one FusedAttention, their heads side by side (layer by layer): query head l x hq + h
    is head h of calls[l], and its key/value head l x hk + h // (hq / hk) still the one it reads. A score pays its
    small operations once per group of layers, not once per layer (short inputs: those operations, not arithmetic,
    are their cost). The calls share one shape, the scaling, no bias and the causal flag; queries and keys are
    copied once, in the layout transformers hands them over ((b, n, h, d) in memory)."""
    first = calls[0]
    assert all(call.shape == first.shape and call.bias is None and call.causal == first.causal
               and call.scaling == first.scaling for call in calls), "side_by_side takes calls of one shape, no bias"

    def heads(tensors: list[Tensor]) -> Tensor:
        return torch.cat([tensor.transpose(1, 2) for tensor in tensors], dim=2).transpose(1, 2)

    return FusedAttention(heads([call.query for call in calls]), heads([call.key for call in calls]), None,
                          first.scaling, first.causal, torch.cat([call.lse for call in calls], dim=1))


@dataclass(frozen=True)
class GatheredKeys:
    """Which keys each query row of a chunk reads (one set per row, shared by its heads), and where they are."""

    inside: Tensor  # (m, k) long: the keys, clamped to existing ones
    hidden: Tensor | None  # (m, k) bool: keys that do not exist or are causally hidden (None: none is)
    index: Tensor  # (b x m x hk x k,) long: the rows of _flat(key) to gather, in (b, m, hk, k) order


@functools.lru_cache(maxsize=64)
def _gathered_keys(b: int, n: int, kv: int, hk: int, offsets: tuple[int, ...], keys: tuple[int, ...], start: int,
                   stop: int, causal: bool, device: torch.device) -> GatheredKeys:
    """The keys i + offset and `keys` of queries start .. stop, and where they are in the flat key rows: the same for
    every layer of a forward (kept, so that a layer pays only for the gather and the matmul)."""
    rows = torch.arange(start, stop, device=device)
    wanted = torch.cat([rows[:, None] + torch.tensor(offsets, dtype=torch.long, device=device),
                        torch.tensor(keys, dtype=torch.long, device=device).expand(len(rows), -1)], dim=1)  # (m, k)
    hidden = (wanted < 0) | (wanted >= kv)
    if causal:
        hidden |= wanted > rows[:, None] + kv - n
    inside = wanted.clamp(0, kv - 1)
    index = (torch.arange(b, device=device)[:, None, None, None] * kv + inside[None, :, None, :]) * hk + \
        torch.arange(hk, device=device)[None, None, :, None]  # (b, m, hk, k)
    return GatheredKeys(inside, hidden if bool(hidden.any()) else None, index.reshape(-1))


def _by_owner(owner: Tensor, read: Callable[..., tuple[Tensor, ...]], *columns: Tensor) -> tuple[Tensor, ...]:
    """read(*columns of one owner's rows) for each owner (the rows grouped by a stable sort of `owner`, at least one),
    its outputs (one value per row each) back in the order of the rows."""
    owner, order = owner.sort(stable=True)
    counts = torch.unique_consecutive(owner, return_counts=True)[1].tolist()
    parts = [read(*part) for part in zip(*(column[order].split(counts) for column in columns))]
    return tuple(torch.empty_like(out).index_copy_(0, order, out)
                 for out in (torch.cat(column) for column in zip(*parts)))


def _best_candidate(upper: Tensor, query: Tensor, threshold: Tensor, head_keys: Tensor) -> Tensor:
    """(r,) the largest float32 logit of query row t among the keys whose bound upper[t] reaches threshold[t] (column c:
    key c + 1), -inf where none does, NaN where more than CANDIDATES do (left to the whole row)."""
    close = upper.float() >= threshold[:, None]  # (r, keys)
    many = close.sum(dim=-1) > CANDIDATES
    row, column = close.masked_fill_(many[:, None], False).nonzero(as_tuple=True)
    logits = (query[row] * head_keys[column + 1]).sum(dim=-1)
    best = torch.full_like(threshold, float("-inf")).scatter_reduce_(0, row, logits, "amax")
    return best.masked_fill_(many, float("nan"))


def _key_is_top(logits: Tensor, keys: Tensor) -> Tensor:
    """(k,) bool: whether key keys[t] holds the largest logit of row t of `logits` (k, keys), as argmax says (the
    earliest maximum wins, a NaN counts as the maximum): the key's logit against the amax of the others (several
    times cheaper than argmax on CPU); only rows where they tie or a NaN is involved go to argmax. `logits` is
    changed (the keys' logits set to -inf, then back)."""
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
    """(b, h, n, d) -> (b x n x h, d): row (b' x n + i) x h + h' is head h' at position i; a view in the layout
    transformers hands queries and keys over in ((b, n, h, d) in memory), else one copy."""
    return heads.transpose(1, 2).reshape(-1, heads.shape[-1])


def fused_attention(query: Tensor, key: Tensor, value: Tensor, bias: Tensor | None, scaling: float,
                    causal: bool) -> tuple[Tensor, FusedAttention]:
    """The layer's attention output (b, n, hq, d) from the fused CPU kernel, and what its weights are rebuilt from.
    Grouped-query heads go to the kernel as they are (it reads the shared keys per query head). `bias` is additive
    (additive_bias); causal applies only without it."""
    plain_causal = causal and bias is None
    output, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, plain_causal, attn_mask=bias, scale=scaling)
    attention = FusedAttention(query, key, bias, scaling, plain_causal, lse.float())
    return output.transpose(1, 2).contiguous(), attention

"""Per-head scores, each a continuous number in [0, 1] with a definition from the literature.

A is one head's attention, rows are queries i, columns keys j; "mean over queries" pools every (sequence, query)
pair of the probe set, padded positions excluded. Each score is reduced from blocks of attention weights as
the layers produce them, so full patterns are never kept.

A new head class is one reduce function here and one `register_score(Score(...))`: the Score names the probe set
its score is computed on (a key of probe.inputs.PROBE_SETS), its default threshold, letter and summary.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from probe.errors import ProbeError
from probe.hooks.blocked import keys_computed
from probe.kernels.fused import Label, Weights, uploaded


@dataclass
class Batch:
    """What a score needs to know of the sequences behind a block of weights."""

    valid: Tensor  # (b, n) bool: real tokens (right padding is False)
    offset: int  # first content position (1 after BOS)
    repeat_len: int | None  # R for repeated sets
    memos: dict[Hashable, Any] = field(default_factory=dict, repr=False, compare=False)

    def memo(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """make(), once per batch: what every layer of the batch reads the same (selections, counts, plans)."""
        if key not in self.memos:
            self.memos[key] = make()
        return self.memos[key]

    def valid_on(self, device: torch.device) -> Tensor:
        """`valid` on `device`, copied once per batch (a copy per layer would wait for a GPU each time)."""
        return self.memo(("valid", str(device)), lambda: uploaded(self.valid, device))


Reduce = Callable[[Tensor, int, Batch], tuple[Tensor, Tensor]]
"""(weights (b, h, block, keys), first query index, batch) -> (per-head sums (h,), per-head counts (h,))."""
Fast = Callable[[Weights, Batch], tuple[Tensor, Tensor]]
"""(one layer call's queries, keys and log-sum-exp, batch) -> the same (sums, counts) as the score's Reduce over all
of its blocks: the fast path (probe.kernels), which never forms the weights' n x n matrix."""
Finish = Callable[[Tensor, Tensor], Tensor]
"""(sums (n_layers, ...), counts of the same shape), pooled over the whole set -> scores (n_layers, n_heads)."""


def mean_score(sums: Tensor, counts: Tensor) -> Tensor:
    """The usual finish: the mean over everything counted (0 where nothing was)."""
    return sums / counts.clamp(min=1)


@dataclass(frozen=True)
class Score:
    """A head class: its score, the probe set it is computed on, and the default label threshold."""

    name: str
    probe: str  # a key of probe.inputs.PROBE_SETS
    threshold: float
    summary: str
    reduce: Reduce
    letter: str = ""  # one character for the layer x head overview; default: the name's first letter
    finish: Finish = mean_score
    by_default: bool = True  # computed by `classify` when no scores are named (False: long or special inputs)
    on_cross: bool = False  # whether the definition holds for cross-attention, whose keys are another sequence's
    fast: Fast | None = None  # the same sums from the log-sum-exp (a Diagonal, Column, ...); None: blocked path only

    def diagonals(self, batch: Batch) -> tuple[int, ...]:
        """The diagonals (key offsets) its fast path reads: the layer computes every score's in one pass."""
        shifts = getattr(self.fast, "shifts", None)
        return () if shifts is None else tuple(shifts(batch))

    def columns(self, batch: Batch) -> tuple[int, ...]:
        """The columns (keys) its fast path reads, computed with the diagonals."""
        keys = getattr(self.fast, "keys", None)
        return () if keys is None else tuple(keys(batch))

    def reads(self, batch: Batch, attention: Weights) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(diagonals, columns) its fast path reads of this layer call: its own (`diagonals`, `columns`), and what
        the record reads to answer the neighbour questions it asks (`Weights.neighbour_reads`: its backend's
        search's, none where the kernel's top keys answer). The layer computes every score's in one pass."""
        asks = getattr(self.fast, "neighbours", None)
        offsets, keys = attention.neighbour_reads(asks(batch)) if asks is not None else ((), ())
        return self.diagonals(batch) + offsets, self.columns(batch) + keys

    @property
    def layers_at_once(self) -> bool:
        """Whether its fast path reads several layers at once (probe.kernels.side_by_side: one call, their heads
        side by side), as the accumulator groups the layer calls of short inputs."""
        return bool(getattr(self.fast, "layers_at_once", False))

    def selection(self, batch: Batch, n: int, kv: int) -> tuple[Label, Tensor] | None:
        """Where its fast path is the mean of one diagonal or column over selected queries: which, and the (b, n)
        queries (None: it computes its own sums)."""
        selection = getattr(self.fast, "selection", None)
        return None if selection is None else selection(batch, n, kv)

    def describe(self) -> dict[str, object]:
        """What a report needs to know of the class: plain values, for to_dict payloads."""
        return {"summary": self.summary, "letter": self.letter or self.name[0].upper(), "probe_set": self.probe,
                "default_threshold": self.threshold}


def _diagonal_rows(start: int, block: int, n_keys: int, shift: int) -> tuple[int, int]:
    """(first row, rows) of a block whose key i + shift exists: the diagonal at offset start + shift."""
    offset = start + shift
    first = max(0, -offset)
    return first, max(0, min(block, n_keys - offset) - first)


def _relative_mass(weights: Tensor, start: int, batch: Batch, shift: int,
                   query_range: tuple[int, int] | None = None) -> tuple[Tensor, Tensor]:
    """Sum and count of A[i, i + shift] over valid queries i (in `query_range`, if given) whose key exists."""
    b, h, block, n_keys = weights.shape
    first, rows = _diagonal_rows(start, block, n_keys, shift)
    queries = torch.arange(start + first, start + first + rows, device=weights.device)
    valid = batch.valid.to(weights.device)
    selected = valid[:, queries] & valid[:, queries + shift]  # (b, rows)
    if query_range is not None:
        selected &= (queries >= query_range[0]) & (queries < query_range[1])
    values = weights.diagonal(start + shift, dim1=-2, dim2=-1)  # (b, h, rows): a strided view, nothing gathered
    mask = selected[:, None, :].to(values.dtype)
    return (values * mask).sum(dim=(0, 2)).double(), mask.sum(dim=(0, 2)).double().expand(h)


def _column_mass(weights: Tensor, start: int, batch: Batch, column: int) -> tuple[Tensor, Tensor]:
    b, h, block, _ = weights.shape
    selected = batch.valid.to(weights.device)[:, start:start + block]
    mask = selected[:, None, :].to(weights.dtype)
    return (weights[..., column] * mask).sum(dim=(0, 2)).double(), mask.sum(dim=(0, 2)).double().expand(h)


def _counted(values: Tensor, selected: Tensor) -> tuple[Tensor, Tensor]:
    """values (b, h, m) and selected (b, m) -> per-head sum over the selected entries and their count."""
    mask = selected[:, None, :].to(values.dtype)
    return (values * mask).sum(dim=(0, 2)).double(), mask.sum(dim=(0, 2)).double().expand(values.shape[1])


@dataclass(frozen=True)
class Diagonal:
    """A diagonal-type score: the mean of A[i, i + shift] over valid queries i whose key is valid (and in `queries`,
    [first, stop), where given); both may depend on the batch (induction's on the repeat length). The declaration is
    both paths: `reduce` on blocks of weights, and the object itself (a `Fast`) on the log-sum-exp."""

    shift: Callable[[Batch], int]
    queries: Callable[[Batch], tuple[int, int]] | None = None

    def reduce(self, weights: Tensor, start: int, batch: Batch) -> tuple[Tensor, Tensor]:
        """The blocked path's Reduce."""
        return _relative_mass(weights, start, batch, self.shift(batch),
                              None if self.queries is None else self.queries(batch))

    def shifts(self, batch: Batch) -> tuple[int, ...]:
        """The one diagonal it reads."""
        return (self.shift(batch),)

    def selection(self, batch: Batch, n: int, kv: int) -> tuple[Label, Tensor]:
        """The diagonal it averages, and the (b, n) queries it averages over: valid, their key valid and existing,
        in `queries` where given (ScoreAccumulator reads every such score of a layer in one product)."""
        shift = self.shift(batch)
        queries = torch.arange(n, device=batch.valid.device)
        keys = queries + shift
        selected = batch.valid[:, :n] & batch.valid[:, keys.clamp(0, n - 1)] & (keys >= 0) & (keys < kv)
        if self.queries is not None:
            low, high = self.queries(batch)
            selected &= (queries >= low) & (queries < high)
        return Label("diagonal", shift), selected

    def __call__(self, attention: Weights, batch: Batch) -> tuple[Tensor, Tensor]:
        (_, shift), selected = self.selection(batch, attention.shape[2], attention.shape[3])
        return _counted(attention.aligned(shift), selected.to(attention.lse.device))


@dataclass(frozen=True)
class Column:
    """A column-type score: the mean of A[i, key] over valid queries i."""

    key: int

    def keys(self, batch: Batch) -> tuple[int, ...]:
        """The one column it reads."""
        return (self.key,)

    def reduce(self, weights: Tensor, start: int, batch: Batch) -> tuple[Tensor, Tensor]:
        """The blocked path's Reduce."""
        return _column_mass(weights, start, batch, self.key)

    def selection(self, batch: Batch, n: int, kv: int) -> tuple[Label, Tensor]:
        """The column it averages, and the (b, n) queries it averages over: the valid ones."""
        return Label("column", self.key), batch.valid[:, :n]

    def __call__(self, attention: Weights, batch: Batch) -> tuple[Tensor, Tensor]:
        values = attention.column(self.key)
        return _counted(values, batch.valid.to(values.device)[:, :values.shape[-1]])


@dataclass(frozen=True)
class ReadsDiagonals:
    """A fast path that reads fixed diagonals (among other things), declared so that they are computed with the
    other scores' in one pass; and the shifts whose `Weights.neighbour_hits` it asks, whose reads the record
    declares (`Score.reads`: what a backend's search reads, none from a kernel's top keys)."""

    compute: Fast
    offsets: tuple[int, ...] = ()
    key_columns: tuple[int, ...] = ()
    layers_at_once: bool = False  # `compute` reads several layers as one call (side_by_side: their heads side by side)
    neighbour_shifts: tuple[int, ...] = ()  # the shifts `compute` asks neighbour_hits of

    def shifts(self, batch: Batch) -> tuple[int, ...]:
        return self.offsets

    def keys(self, batch: Batch) -> tuple[int, ...]:
        return self.key_columns

    def neighbours(self, batch: Batch) -> tuple[int, ...]:
        return self.neighbour_shifts

    def __call__(self, attention: Weights, batch: Batch) -> tuple[Tensor, Tensor]:
        return self.compute(attention, batch)


def diagonal_score(name: str, probe: str, threshold: float, summary: str, shift: Callable[[Batch], int],
                   queries: Callable[[Batch], tuple[int, int]] | None = None, **options: object) -> Score:
    """A head class that is one diagonal of A, with both paths from its declaration (register it with
    register_score): `diagonal_score("two_back", "natural", 0.5, "attends two tokens back", lambda b: -2)`."""
    declared = Diagonal(shift, queries)
    return Score(name, probe, threshold, summary, declared.reduce, fast=declared, **options)  # type: ignore[arg-type]


def previous_token_score(weights: Tensor, start: int, batch: Batch) -> tuple[Tensor, Tensor]:
    """Mean over queries i >= 1 of A[i, i-1]: previous-token heads (Olsson et al. 2022, "In-context Learning and
    Induction Heads"; the first half of an induction circuit in Elhage et al. 2021)."""
    return _relative_mass(weights, start, batch, -1)


def sink_score(weights: Tensor, start: int, batch: Batch) -> tuple[Tensor, Tensor]:
    """Mean over all queries of A[i, 0]: alpha_1, the attention-sink metric of Gu et al. 2024, "When Attention Sink
    Emerges in Language Models" (Xiao et al. 2023 named the sink)."""
    return _column_mass(weights, start, batch, 0)


def _last_keys(batch: Batch) -> Tensor:
    """(b,) each sequence's last real position (right padding): [SEP] in an encoder's [CLS] ... [SEP] input."""
    return batch.valid.sum(dim=1) - 1


def sep_score(weights: Tensor, start: int, batch: Batch) -> tuple[Tensor, Tensor]:
    """Mean over valid queries of A[i, last]: attention to the closing [SEP] of an encoder's input, which Clark et
    al. 2019 ("What Does BERT Look At?") find holds most of many BERT heads' attention in the middle layers (read as
    a no-op). On a causal model only the last query sees that key, so the score stays near 0."""
    b, h, block, _ = weights.shape
    last = _last_keys(batch).to(weights.device).clamp(min=0)
    values = weights.gather(-1, last[:, None, None, None].expand(b, h, block, 1))[..., 0]
    return _counted(values, batch.valid.to(weights.device)[:, start:start + block])


def sep_from_lse(attention: Weights, batch: Batch) -> tuple[Tensor, Tensor]:
    """sep_score's sums from the log-sum-exp: one column per distinct last position (one, without padding)."""
    device = attention.lse.device
    values = None
    for key, owners in batch.memo(("sep keys", str(device)), lambda: _last_key_owners(batch, device)):
        column = attention.column(key)  # (b, h, n)
        values = column if values is None else torch.where(owners[:, None, None], column, values)
    assert values is not None
    return _counted(values, batch.valid_on(device)[:, :values.shape[-1]])


def _last_key_owners(batch: Batch, device: torch.device) -> list[tuple[int, Tensor]]:
    """Each distinct last position of the batch, with the (b,) sequences ending there on `device` (once per batch:
    read on the host, not per layer)."""
    last = _last_keys(batch).clamp(min=0)
    return [(int(key), uploaded(last == key, device)) for key in last.unique().tolist()]


def induction_score(weights: Tensor, start: int, batch: Batch) -> tuple[Tensor, Tensor]:
    """On BOS + R random tokens repeated twice, mean over second-repeat queries i of A[i, i-R+1]: attention to the
    token after the earlier copy (prefix matching, Olsson et al. 2022)."""
    first, repeat = batch.offset, _repeat_len(batch)
    return _relative_mass(weights, start, batch, 1 - repeat, (first + repeat, first + 2 * repeat))


def duplicate_token_score(weights: Tensor, start: int, batch: Batch) -> tuple[Tensor, Tensor]:
    """Same data as induction, mean over second-repeat queries i of A[i, i-R]: attention to the earlier copy of
    the current token (duplicate-token heads, Wang et al. 2022, "Interpretability in the Wild")."""
    first, repeat = batch.offset, _repeat_len(batch)
    return _relative_mass(weights, start, batch, -repeat, (first + repeat, first + 2 * repeat))


def next_token_score(weights: Tensor, start: int, batch: Batch) -> tuple[Tensor, Tensor]:
    """Mean over queries of A[i, i+1] (queries with a next token): next-token heads of bidirectional encoders
    (Clark et al. 2019, "What Does BERT Look At?"). Zero by construction in a causal model."""
    return _relative_mass(weights, start, batch, 1)


NEIGHBOURS = (-1, 1)
"""The neighbours i + shift whose share of rows' top keys positional counts."""


def positional_score(weights: Tensor, start: int, batch: Batch) -> tuple[Tensor, Tensor]:
    """Fraction of queries whose most-attended key is one fixed neighbour (i-1 or i+1, whichever is more often),
    after Voita et al. 2019, "Analyzing Multi-Head Self-Attention", who call a head positional when that fraction is
    at least 90%. Returns sums and counts for both neighbours stacked, (2, h); `finish_positional` picks the larger.

    Exactly argmax's answer (a NaN counts as the maximum, the earliest maximum wins), computed with amax, which is
    several times faster on CPU: the neighbour k = i +- 1 is the argmax when it holds the row's maximum, no key before
    the band of neighbours (start-1 .. start+block) holds it, and no other key of the band does; the rare rows where
    one does are settled by argmax. Keys a causal block never computed (exactly zero) are not read."""
    b, h, block, n_keys = weights.shape
    low, high = max(start - 1, 0), min(start + block + 1, n_keys)
    computed = max(keys_computed(weights), high)
    band = weights[..., low:high]  # (b, h, block, band): every neighbour of the block's queries
    top = band.amax(dim=-1)  # (b, h, block) the row's maximum, with the keys before and after the band:
    earlier = torch.zeros_like(top, dtype=torch.bool)  # a key before the band holds the maximum
    if computed > high:
        top = torch.maximum(top, weights[..., high:computed].amax(dim=-1))
    if low > 0:
        before = weights[..., :low].amax(dim=-1)
        top = torch.maximum(top, before)
        earlier = (before == top) | before.isnan()
    unsure = top.isnan()
    valid = batch.valid.to(weights.device)
    sums, counts = [], []
    for shift in NEIGHBOURS:
        first, rows = _diagonal_rows(start, block, n_keys, shift)
        queries = torch.arange(start + first, start + first + rows, device=weights.device)
        selected = valid[:, queries] & valid[:, queries + shift]  # (b, rows)
        part = slice(first, first + rows)
        at_key = band.diagonal(start + shift - low, dim1=-2, dim2=-1)  # (b, h, rows) a view of the neighbours
        hit = ((at_key == top[..., part]) | unsure[..., part]) & selected[:, None, :] & ~earlier[..., part]
        others = _band_max_without(band, start + shift - low)[..., part]
        tied = hit & (others == top[..., part]) | (hit & unsure[..., part])
        if bool(tied.any()):  # another key of the band holds the maximum too, or a NaN: argmax settles it
            rows_b, rows_h, rows_r = tied.nonzero(as_tuple=True)
            keys = queries[rows_r] + shift
            hit[rows_b, rows_h, rows_r] = weights[rows_b, rows_h, rows_r + first, :computed].argmax(dim=-1) == keys
        sums.append(hit.sum(dim=(0, 2)).double())
        counts.append(selected.sum().double().expand(h))
    return torch.stack(sums), torch.stack(counts)


def _band_max_without(band: Tensor, offset: int) -> Tensor:
    """Each row's maximum over the band but one key, the band's diagonal at `offset`: the diagonal is set aside for
    one amax and put back bit for bit (a strided write of one key per row, no copy of the band)."""
    diagonal = band.diagonal(offset, dim1=-2, dim2=-1)
    kept = diagonal.clone()
    try:
        diagonal.fill_(float("-inf"))
    except RuntimeError:  # a tensor that cannot be written (expanded, an inference tensor): work on a copy
        band = band.clone()
        band.diagonal(offset, dim1=-2, dim2=-1).fill_(float("-inf"))
        return band.amax(dim=-1)
    try:
        return band.amax(dim=-1)
    finally:
        diagonal.copy_(kept)


def finish_positional(sums: Tensor, counts: Tensor) -> Tensor:
    """sums, counts (n_layers, 2, n_heads) for the neighbours i-1 and i+1 -> the larger fraction (n_layers, n_heads)."""
    return mean_score(sums, counts).max(dim=1).values


def positional_from_lse(attention: Weights, batch: Batch) -> tuple[Tensor, Tensor]:
    """positional_score's sums and counts from the fused statistics: for each neighbour, the valid queries whose
    neighbour exists and is valid are counted, and the statistics say for how many of them that neighbour holds the
    row's maximum (`neighbour_hits`: argmax's answer; the CPU backend's by a staged search that reads whole rows only
    for the rows its cheap stages cannot decide, probe.kernels.cpu; the CUDA backend's from its kernel's top keys).
    It reads nothing else: what neighbour_hits reads is the record's to declare (`neighbour_shifts`, Score.reads)."""
    b, h, n, kv = attention.shape
    device = attention.lse.device  # the rows are taken there once per batch (memo): no copy per layer
    hits, counts = [], []
    for shift in NEIGHBOURS:
        selected, count = batch.memo(("neighbours", n, kv, shift, str(device)),
                                     lambda: _neighbour_rows(batch.valid, kv, shift, device))
        counts.append(count)
        hidden = attention.bias is None and attention.causal and shift > kv - n  # the neighbour is causally hidden
        hits.append(torch.zeros(h, dtype=torch.float64, device=device) if hidden else
                    attention.neighbour_hits(selected, shift))  # where it counts: a kernel's top keys on its device
    return torch.stack(hits), batch.memo(("neighbour counts", n, kv, h), lambda: torch.tensor(
        counts, dtype=torch.float64)[:, None].expand(2, h))  # counts: on the host (no round-trip either)


def _neighbour_rows(valid: Tensor, kv: int, shift: int,
                    device: torch.device | None = None) -> tuple[Tensor, float]:
    """((b, n) the valid queries whose neighbour i + shift exists and is valid, on `device` (default: valid's), how
    many there are)."""
    n = valid.shape[1]
    keys = torch.arange(n, device=valid.device) + shift
    selected = valid & valid[:, keys.clamp(0, n - 1)] & (keys >= 0) & (keys < kv)
    return uploaded(selected, device or valid.device), float(selected.sum())


@dataclass
class NeedleBatch(Batch):
    """A batch of needle prompts (probe.inputs.needle): which needle key each answer position's target is copied
    from."""

    sources: Tensor | None = None  # (b, n) long: for query i, the needle position of token i + 1; -1 elsewhere
    correct: Tensor | None = None  # (b, n) bool: the model predicts token i + 1 at i (None: not known yet)


DEFAULT_SINK = 4
DEFAULT_RECENT = 256


def window_keys(queries: Tensor, keys: Tensor, sink: int, recent: int) -> Tensor:
    """(len(queries), len(keys)) bool: the keys a sink + recent cache keeps for each query position (StreamingLLM,
    Xiao et al. 2023): the first `sink` keys and the `recent` most recent ones, the query's own included (keys after
    the query are the caller's to mask)."""
    return (keys[None, :] < sink) | (keys[None, :] > queries[:, None] - recent)


def streaming_score(weights: Tensor, start: int, batch: Batch, sink: int = DEFAULT_SINK,
                    recent: int = DEFAULT_RECENT) -> tuple[Tensor, Tensor]:
    """Mean over queries i >= sink + recent of the attention mass on the first `sink` keys and the `recent` most
    recent ones: how much of the head a StreamingLLM cache (Xiao et al. 2023, "Efficient Streaming Language Models
    with Attention Sinks") keeps; DuoAttention (Xiao et al. 2024) streams the heads that need nothing else."""
    b, h, block, n_keys = weights.shape
    first = max(start, sink + recent)  # the first query counted: its window lies past the sink keys
    if first >= start + block:
        return torch.zeros(h, dtype=torch.float64), torch.zeros(h, dtype=torch.float64)
    rows = weights[:, :, first - start:]  # (b, h, m, keys), a view
    m = rows.shape[2]
    stride = rows.stride()
    # the `recent` keys ending at each query, as a strided view: row q's band starts at key first + q - recent + 1
    band = rows.as_strided((b, h, m, recent), (stride[0], stride[1], stride[2] + stride[3], stride[3]),
                           rows.storage_offset() + (first - recent + 1) * stride[3])
    mass = band.sum(dim=-1) + rows[..., :sink].sum(dim=-1)  # (b, h, m)
    mask = batch.valid.to(weights.device)[:, first:start + block][:, None, :].to(mass.dtype)
    return (mass * mask).sum(dim=(0, 2)).double(), mask.sum(dim=(0, 2)).double().expand(h)


def streaming_from_lse(attention: Weights, batch: Batch, sink: int = DEFAULT_SINK,
                       recent: int = DEFAULT_RECENT) -> tuple[Tensor, Tensor]:
    """streaming_score's sums and counts from the log-sum-exp: the band of the `recent` keys ending at each query and
    the first `sink` columns, computed for queries i >= sink + recent only (O(n x (sink + recent)) per head)."""
    b, h, n, _ = attention.shape
    first = sink + recent
    if first >= n:
        return torch.zeros(h, dtype=torch.float64), torch.zeros(h, dtype=torch.float64)
    attention.prefetch((), range(sink))  # the sink columns in one pass
    sinks = sum((attention.column(key)[..., first:] for key in range(sink)), attention.lse.new_zeros(b, h, n - first))
    valid = batch.valid_on(attention.lse.device)
    sums = counts = attention.lse.new_zeros(h, dtype=torch.float64)  # on the device: nothing read back per chunk
    for start, band in attention.band(1 - recent, 0, first):  # (b, h, rows, recent): keys i - recent + 1 .. i
        stop = start + band.shape[2]
        part_sums, part_counts = _counted(band.sum(dim=-1) + sinks[..., start - first:stop - first],
                                          valid[:, start:stop])
        sums, counts = sums + part_sums, counts + part_counts
    return sums, counts


def retrieval_rows(sources: Tensor, correct: Tensor) -> Tensor:
    """The rows Wu et al. score (bool, `sources`' shape): the target is copied from the needle (its source, the
    needle position, is >= 0) and the model predicts it correctly."""
    return (sources >= 0) & correct


def retrieval_hits(top: Tensor, source: Tensor) -> Tensor:
    """Wu et al.'s copy-paste test, the one definition of the retrieval score (retrieval_score here, probe.kv's
    from the kernels' top keys): per head, how many scored rows' most-attended key is the needle token their target
    copies. `top` (rows, h): each scored row's most-attended key; `source` (rows,): that needle position. (h,)
    float64; divided by the rows, the score."""
    return (top == source[:, None]).sum(dim=0).double()


def retrieval_score(weights: Tensor, start: int, batch: Batch) -> tuple[Tensor, Tensor]:
    """Wu et al. 2024, "Retrieval Head Mechanistically Explains Long-Context Factuality": over the answer positions
    of needle prompts whose target token is copied from the needle and which the model predicts correctly, the
    fraction where the head's most-attended key is that needle token (copy-paste). Needs a NeedleBatch whose
    `correct` is known: `probe.kv` gathers the answer rows during the forward and scores them after it."""
    sources, correct = getattr(batch, "sources", None), getattr(batch, "correct", None)
    if sources is None or correct is None:
        raise ProbeError("the retrieval score needs needle prompts and the model's predictions on them: "
                         "use probe.kv_heads (probe kv-heads)", parameter="scores")
    b, h, block, _ = weights.shape
    source = sources[:, start:start + block].to(weights.device)  # (b, block)
    selected = retrieval_rows(source, correct[:, start:start + block].to(weights.device)) & \
        batch.valid[:, start:start + block].to(weights.device)
    if not bool(selected.any()):
        return torch.zeros(h, dtype=torch.float64), torch.zeros(h, dtype=torch.float64)
    rows = selected.nonzero(as_tuple=True)  # (batch index, query) pairs
    top = weights[rows[0], :, rows[1]].argmax(dim=-1)  # (selected, h)
    return retrieval_hits(top, source[rows]), torch.full((h,), float(top.shape[0]), dtype=torch.float64)


def retrieval_from_lse(attention: Weights, batch: Batch) -> tuple[Tensor, Tensor]:
    """retrieval_score from the log-sum-exp: only the answer rows' weights are computed, whole (exact maxima)."""
    sources, correct = getattr(batch, "sources", None), getattr(batch, "correct", None)
    if sources is None or correct is None:
        return retrieval_score(attention.lse[..., None], 0, batch)  # raises: the score needs needle prompts
    rows = ((sources >= 0) & correct & batch.valid).any(dim=0).nonzero()[:, 0]
    answers = NeedleBatch(valid=batch.valid[:, rows], offset=batch.offset, repeat_len=None, sources=sources[:, rows],
                          correct=correct[:, rows])
    return retrieval_score(attention.rows(rows.to(attention.lse.device)), 0, answers)


def _repeat_len(batch: Batch) -> int:
    if batch.repeat_len is None:
        raise ProbeError("this score needs a repeated probe set (one with a repeat_len)")
    return batch.repeat_len


SCORES: dict[str, Score] = {}
"""Every head class probe computes, in report order; thresholds are the defaults, overridable per run."""


def register_score(score: Score) -> Score:
    """Add a head class (a new name: replacing one would change what earlier results mean)."""
    if score.name in SCORES:
        raise ProbeError(f"a head class named {score.name!r} exists already")
    SCORES[score.name] = score
    return score


def _previous(batch: Batch) -> int:
    return -1


def _induction_shift(batch: Batch) -> int:
    return 1 - _repeat_len(batch)


def _duplicate_shift(batch: Batch) -> int:
    return -_repeat_len(batch)


def _second_repeat(batch: Batch) -> tuple[int, int]:
    return batch.offset + _repeat_len(batch), batch.offset + 2 * _repeat_len(batch)


def _next(batch: Batch) -> int:
    return 1


for _score in (
    Score("previous_token", "natural", 0.5, "attends to the previous token", previous_token_score, "P",
          fast=Diagonal(_previous)),
    Score("sink", "natural", 0.3, "attends to the first token (attention sink)", sink_score, "S", on_cross=True,
          fast=Column(0)),
    Score("induction", "repeated", 0.4, "attends to the token after the earlier copy of the current one",
          induction_score, "I", fast=Diagonal(_induction_shift, _second_repeat)),
    Score("duplicate_token", "repeated", 0.4, "attends to the earlier copy of the current token",
          duplicate_token_score, "D", fast=Diagonal(_duplicate_shift, _second_repeat)),
    Score("next_token", "natural", 0.5, "attends to the next token (encoders)", next_token_score, "N",
          fast=Diagonal(_next)),
    Score("sep", "natural", 0.3, "attends to the closing [SEP] (encoders; Clark et al. 2019)", sep_score, "E",
          fast=sep_from_lse),
    Score("positional", "natural", 0.9, "its strongest attention is on one fixed neighbour (Voita et al.)",
          positional_score, "O", finish_positional,
          fast=ReadsDiagonals(positional_from_lse, layers_at_once=True, neighbour_shifts=NEIGHBOURS)),
    Score("streaming", "natural", 0.9, "sink + recent keys hold its attention (StreamingLLM's cache, 4 + 256)",
          streaming_score, "W", by_default=False, fast=streaming_from_lse),
    Score("retrieval", "needle", 0.1, "copies the needle token it attends to (Wu et al. 2024)", retrieval_score,
          "R", by_default=False, fast=retrieval_from_lse),
):
    register_score(_score)


LOCAL_WINDOW = 4  # the local class's band: the current token and the 2nd .. 4th tokens back


def local_score(weights: Tensor, start: int, batch: Batch) -> tuple[Tensor, Tensor]:
    """Mean over queries i >= LOCAL_WINDOW of the attention on keys i - LOCAL_WINDOW .. i but i - 1: local heads,
    whose attention stays in a narrow band on the diagonal, Kovaleva et al. 2019's "diagonal" pattern ("Revealing
    the Dark Secrets of BERT") and the local attention Child et al. 2019 build in ("Generating Long Sequences with
    Sparse Transformers"). The previous token is left out: previous-token heads are a class of their own."""
    queries = (LOCAL_WINDOW, weights.shape[-1])  # every key of the band exists
    sums, counts = _relative_mass(weights, start, batch, 0, queries)
    for shift in range(2, LOCAL_WINDOW + 1):
        sums = sums + _relative_mass(weights, start, batch, -shift, queries)[0]
    return sums, counts


register_score(Score("local", "natural", 0.5, f"attends to itself and the 2nd to {LOCAL_WINDOW}th tokens back (a "
                     "local band; the previous token excluded)", local_score, "L", by_default=False))

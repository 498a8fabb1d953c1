"""Per-head scores, each a continuous number in [0, 1] with a definition from the literature.

A is one head's attention, rows are queries i, columns keys j; "mean over queries" pools every (sequence, query)
pair of the probe set, padded positions excluded. Each score is reduced from blocks of weights as the layers produce
them, so full patterns are never kept; this path alone computes every class. A new class is one reduce function and
one `register_score(Score(...))`; a faster path from fused statistics is an accelerator's (probe.accel).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from probe.errors import ProbeError
from probe.hooks.blocked import keys_computed


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


Reduce = Callable[[Tensor, int, Batch], tuple[Tensor, Tensor]]
"""(weights (b, h, block, keys), first query index, batch) -> (per-head sums (h,), per-head counts (h,))."""
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

    def describe(self) -> dict[str, object]:
        """What a report needs to know of the class: plain values, for to_dict payloads (and where its heads attend
        on a repeated sequence, for a class that declares it in REPEAT_DIAGONALS)."""
        diagonal = REPEAT_DIAGONALS.get(self.name)
        return {"summary": self.summary, "letter": self.letter or self.name[0].upper(), "probe_set": self.probe,
                "default_threshold": self.threshold, **({"diagonal": diagonal} if diagonal is not None else {})}


def _diagonal_queries(start: int, block: int, n_keys: int, shift: int, valid: Tensor) -> tuple[int, Tensor, Tensor]:
    """(first row, queries, (b, rows) selected) of a block's queries whose key i + shift exists (the diagonal at
    offset start + shift), selected where query and key are valid."""
    offset = start + shift
    first = max(0, -offset)
    queries = torch.arange(start + first, start + max(first, min(block, n_keys - offset)), device=valid.device)
    return first, queries, valid[:, queries] & valid[:, queries + shift]


def diagonal_mass(weights: Tensor, start: int, batch: Batch, shift: int,
                  query_range: tuple[int, int] | None = None) -> tuple[Tensor, Tensor]:
    """Sum and count of A[i, i + shift] over valid queries i (in `query_range`, if given) whose key exists."""
    b, h, block, n_keys = weights.shape
    _, queries, selected = _diagonal_queries(start, block, n_keys, shift, batch.valid.to(weights.device))
    if query_range is not None:
        selected &= (queries >= query_range[0]) & (queries < query_range[1])
    return selected_sums(weights.diagonal(start + shift, dim1=-2, dim2=-1), selected)  # a strided view


def column_mass(weights: Tensor, start: int, batch: Batch, column: int) -> tuple[Tensor, Tensor]:
    """Sum and count of A[i, column] over valid queries i."""
    return selected_sums(weights[..., column], batch.valid.to(weights.device)[:, start:start + weights.shape[2]])


def selected_sums(values: Tensor, selected: Tensor) -> tuple[Tensor, Tensor]:
    """values (b, h, m) and selected (b, m) -> per-head sum over the selected entries and their count."""
    mask = selected[:, None, :].to(values.dtype)
    return (values * mask).sum(dim=(0, 2)).double(), mask.sum(dim=(0, 2)).double().expand(values.shape[1])


def previous_token_score(weights: Tensor, start: int, batch: Batch) -> tuple[Tensor, Tensor]:
    """Mean over queries i >= 1 of A[i, i-1]: previous-token heads (Olsson et al. 2022, "In-context Learning and
    Induction Heads"; the first half of an induction circuit in Elhage et al. 2021)."""
    return diagonal_mass(weights, start, batch, -1)


def sink_score(weights: Tensor, start: int, batch: Batch) -> tuple[Tensor, Tensor]:
    """Mean over all queries of A[i, 0]: alpha_1, the attention-sink metric of Gu et al. 2024, "When Attention Sink
    Emerges in Language Models" (Xiao et al. 2023 named the sink)."""
    return column_mass(weights, start, batch, 0)


def last_keys(batch: Batch) -> Tensor:
    """(b,) each sequence's last real position (right padding): [SEP] in an encoder's [CLS] ... [SEP] input."""
    return batch.valid.sum(dim=1) - 1


def sep_score(weights: Tensor, start: int, batch: Batch) -> tuple[Tensor, Tensor]:
    """Mean over valid queries of A[i, last]: attention to the closing [SEP] of an encoder's input, which Clark et
    al. 2019 ("What Does BERT Look At?") find holds most of many BERT heads' attention in the middle layers (read as
    a no-op). On a causal model only the last query sees that key, so the score stays near 0."""
    b, h, block, _ = weights.shape
    last = last_keys(batch).to(weights.device).clamp(min=0)
    values = weights.gather(-1, last[:, None, None, None].expand(b, h, block, 1))[..., 0]
    return selected_sums(values, batch.valid.to(weights.device)[:, start:start + block])


REPEAT_DIAGONALS = {"induction": 1, "duplicate_token": 0}
"""Where a head of a class attends on a repeated sequence (R tokens, then the same R again), as key - query + R: an
induction head looks at the token after the earlier copy of the current one (k = q - R + 1), a duplicate-token head
at that copy (k = q - R)."""


def induction_score(weights: Tensor, start: int, batch: Batch) -> tuple[Tensor, Tensor]:
    """On BOS + R random tokens repeated twice, mean over second-repeat queries i of A[i, i-R+1]: attention to the
    token after the earlier copy (prefix matching, Olsson et al. 2022)."""
    return diagonal_mass(weights, start, batch, REPEAT_DIAGONALS["induction"] - repeat_len(batch),
                         second_repeat(batch))


def duplicate_token_score(weights: Tensor, start: int, batch: Batch) -> tuple[Tensor, Tensor]:
    """Same data as induction, mean over second-repeat queries i of A[i, i-R]: attention to the earlier copy of
    the current token (duplicate-token heads, Wang et al. 2022, "Interpretability in the Wild")."""
    return diagonal_mass(weights, start, batch, REPEAT_DIAGONALS["duplicate_token"] - repeat_len(batch),
                         second_repeat(batch))


def next_token_score(weights: Tensor, start: int, batch: Batch) -> tuple[Tensor, Tensor]:
    """Mean over queries of A[i, i+1] (queries with a next token): next-token heads of bidirectional encoders
    (Clark et al. 2019, "What Does BERT Look At?"). Zero by construction in a causal model."""
    return diagonal_mass(weights, start, batch, 1)


NEIGHBOURS = (-1, 1)
"""The neighbours i + shift whose share of rows' top keys positional counts."""


def positional_score(weights: Tensor, start: int, batch: Batch) -> tuple[Tensor, Tensor]:
    """Fraction of queries whose most-attended key is one fixed neighbour (i-1 or i+1, whichever is more often),
    after Voita et al. 2019, "Analyzing Multi-Head Self-Attention", who call a head positional when that fraction is
    at least 90%. Returns sums and counts for both neighbours stacked, (2, h); `finish_positional` picks the larger.
    Exactly argmax's answer, computed with amax (several times faster on CPU): ties with another key go to argmax."""
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
        first, queries, selected = _diagonal_queries(start, block, n_keys, shift, valid)
        part = slice(first, first + len(queries))
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


@dataclass
class NeedleBatch(Batch):
    """A batch of needle prompts (probe.inputs.needle): the needle key each answer's target is copied from."""

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
    return selected_sums(mass, batch.valid.to(weights.device)[:, first:start + block])


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


def repeat_len(batch: Batch) -> int:
    """R, the repeat length of a repeated probe set's batch (refused on any other)."""
    if batch.repeat_len is None:
        raise ProbeError("this score needs a repeated probe set (one with a repeat_len)")
    return batch.repeat_len


def second_repeat(batch: Batch) -> tuple[int, int]:
    """[first, stop) of the second repeat's queries: the ones induction and duplicate-token scores count."""
    return batch.offset + repeat_len(batch), batch.offset + 2 * repeat_len(batch)


SCORES: dict[str, Score] = {}
"""Every head class probe computes, in report order; thresholds are the defaults, overridable per run."""


def register_score(score: Score) -> Score:
    """Add a head class (a new name: replacing one would change what earlier results mean; a letter of its own: the
    layer x head overview tells classes apart by it)."""
    if score.name in SCORES:
        raise ProbeError(f"a head class named {score.name!r} exists already")
    letter = score.describe()["letter"]
    taken = next((name for name, known in SCORES.items() if known.describe()["letter"] == letter), None)
    if taken is not None:
        raise ProbeError(f"head class {score.name!r}: letter {letter!r} is {taken!r}'s already: give it one of its own")
    SCORES[score.name] = score
    return score


for _score in (
    Score("previous_token", "natural", 0.5, "attends to the previous token", previous_token_score, "P"),
    Score("sink", "natural", 0.3, "attends to the first token (attention sink)", sink_score, "S", on_cross=True),
    Score("induction", "repeated", 0.4, "attends to the token after the earlier copy of the current one",
          induction_score, "I"),
    Score("duplicate_token", "repeated", 0.4, "attends to the earlier copy of the current token",
          duplicate_token_score, "D"),
    Score("next_token", "natural", 0.5, "attends to the next token (encoders)", next_token_score, "N"),
    Score("sep", "natural", 0.3, "attends to the closing [SEP] (encoders; Clark et al. 2019)", sep_score, "E"),
    Score("positional", "natural", 0.9, "its strongest attention is on one fixed neighbour (Voita et al.)",
          positional_score, "O", finish_positional),
    Score("streaming", "natural", 0.9, "sink + recent keys hold its attention (StreamingLLM's cache, 4 + 256)",
          streaming_score, "W", by_default=False),
    Score("retrieval", "needle", 0.1, "copies the needle token it attends to (Wu et al. 2024)", retrieval_score,
          "R", by_default=False),
):
    register_score(_score)


LOCAL_WINDOW = 4  # the local class's band: the current token and the 2nd .. 4th tokens back


def local_score(weights: Tensor, start: int, batch: Batch) -> tuple[Tensor, Tensor]:
    """Mean over queries i >= LOCAL_WINDOW of the attention on keys i - LOCAL_WINDOW .. i but i - 1: local heads,
    whose attention stays in a narrow band on the diagonal, Kovaleva et al. 2019's "diagonal" pattern ("Revealing
    the Dark Secrets of BERT") and the local attention Child et al. 2019 build in ("Generating Long Sequences with
    Sparse Transformers"). The previous token is left out: previous-token heads are a class of their own."""
    queries = (LOCAL_WINDOW, weights.shape[-1])  # every key of the band exists
    sums, counts = diagonal_mass(weights, start, batch, 0, queries)
    for shift in range(2, LOCAL_WINDOW + 1):
        sums = sums + diagonal_mass(weights, start, batch, -shift, queries)[0]
    return sums, counts


register_score(Score("local", "natural", 0.5, f"attends to itself and the 2nd to {LOCAL_WINDOW}th tokens back (a "
                     "local band; the previous token excluded)", local_score, "L", by_default=False))

"""Per-head scores, each a continuous number in [0, 1] with a definition from the literature.

A is one head's attention, rows are queries i, columns keys j; "mean over queries" pools every (sequence, query)
pair of the probe set, padded positions excluded. Each score is reduced from blocks of attention weights as
the layers produce them, so full patterns are never kept.

A new head class is one reduce function here and one `register_score(Score(...))`: the Score names the probe set
its score is computed on (a key of probe.data.PROBE_SETS), its default threshold, letter and summary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from probe.errors import ProbeError

@dataclass
class Batch:
    """What a score needs to know of the sequences behind a block of weights."""

    valid: Tensor  # (b, n) bool: real tokens (right padding is False)
    offset: int  # first content position (1 after BOS)
    repeat_len: int | None  # R for repeated sets


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
    probe: str  # a key of probe.data.PROBE_SETS
    threshold: float
    summary: str
    reduce: Reduce
    letter: str = ""  # one character for the layer x head overview; default: the name's first letter
    finish: Finish = mean_score
    by_default: bool = True  # computed by `classify` when no scores are named (False: long or special inputs)

    def describe(self) -> dict[str, object]:
        """What a report needs to know of the class: plain values, for to_dict payloads."""
        return {"summary": self.summary, "letter": self.letter or self.name[0].upper(), "probe_set": self.probe,
                "default_threshold": self.threshold}


def _relative_mass(weights: Tensor, start: int, batch: Batch, shift: int,
                   query_range: tuple[int, int] | None = None) -> tuple[Tensor, Tensor]:
    """Sum and count of A[i, i + shift] over valid queries i (in `query_range`, if given) whose key exists."""
    b, h, block, n_keys = weights.shape
    queries = torch.arange(start, start + block, device=weights.device)
    keys = queries + shift
    ok = (keys >= 0) & (keys < n_keys)
    if query_range is not None:
        ok &= (queries >= query_range[0]) & (queries < query_range[1])
    valid = batch.valid.to(weights.device)
    selected = ok[None, :] & valid[:, start:start + block] & valid[:, keys.clamp(0, n_keys - 1)]  # (b, block)
    index = keys.clamp(0, n_keys - 1).view(1, 1, block, 1).expand(b, h, block, 1)
    values = weights.gather(-1, index).squeeze(-1)  # (b, h, block)
    mask = selected[:, None, :].to(values.dtype)
    return (values * mask).sum(dim=(0, 2)).double(), mask.sum(dim=(0, 2)).double().expand(h)


def _column_mass(weights: Tensor, start: int, batch: Batch, column: int) -> tuple[Tensor, Tensor]:
    b, h, block, _ = weights.shape
    selected = batch.valid.to(weights.device)[:, start:start + block]
    mask = selected[:, None, :].to(weights.dtype)
    return (weights[..., column] * mask).sum(dim=(0, 2)).double(), mask.sum(dim=(0, 2)).double().expand(h)


def previous_token_score(weights: Tensor, start: int, batch: Batch) -> tuple[Tensor, Tensor]:
    """Mean over queries i >= 1 of A[i, i-1]: previous-token heads (Olsson et al. 2022, "In-context Learning and
    Induction Heads"; the first half of an induction circuit in Elhage et al. 2021)."""
    return _relative_mass(weights, start, batch, -1)


def sink_score(weights: Tensor, start: int, batch: Batch) -> tuple[Tensor, Tensor]:
    """Mean over all queries of A[i, 0]: alpha_1, the attention-sink metric of Gu et al. 2024, "When Attention Sink
    Emerges in Language Models" (Xiao et al. 2023 named the sink)."""
    return _column_mass(weights, start, batch, 0)


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


def positional_score(weights: Tensor, start: int, batch: Batch) -> tuple[Tensor, Tensor]:
    """Fraction of queries whose most-attended key is one fixed neighbour (i-1 or i+1, whichever is more often),
    after Voita et al. 2019, "Analyzing Multi-Head Self-Attention", who call a head positional when that fraction is
    at least 90%. Returns sums and counts for both neighbours stacked, (2, h); `finish_positional` picks the larger."""
    b, h, block, n_keys = weights.shape
    queries = torch.arange(start, start + block, device=weights.device)
    top = weights.amax(dim=-1)  # (b, h, block); amax is several times faster than argmax on CPU
    unsure = top.isnan()  # argmax takes a NaN as the maximum; settle such rows by argmax below
    valid = batch.valid.to(weights.device)
    results = []
    for shift in (-1, 1):
        keys = queries + shift
        ok = (keys >= 0) & (keys < n_keys)
        selected = ok[None, :] & valid[:, start:start + block] & valid[:, keys.clamp(0, n_keys - 1)]
        index = keys.clamp(0, n_keys - 1).view(1, 1, block, 1).expand(b, h, block, 1)
        at_key = weights.gather(-1, index).squeeze(-1)  # (b, h, block)
        hit = ((at_key == top) | unsure) & selected[:, None, :]
        # the key holds the maximum: it is the argmax unless an earlier key ties with it, which the argmax of the
        # keys up to it settles (all keys where a row has a NaN)
        prefix = n_keys if bool(unsure.any()) else min(n_keys, start + block + 1)
        for head in range(h):
            rows = hit[:, head].nonzero(as_tuple=True)
            if rows[0].numel():
                first = weights[:, head, :, :prefix][rows].argmax(dim=-1)
                hit[:, head][rows] = first == keys[rows[1]]
        results.append((hit.sum(dim=(0, 2)).double(), selected.sum().double().expand(h)))
    return torch.stack([results[0][0], results[1][0]]), torch.stack([results[0][1], results[1][1]])


def finish_positional(sums: Tensor, counts: Tensor) -> Tensor:
    """sums, counts (n_layers, 2, n_heads) for the neighbours i-1 and i+1 -> the larger fraction (n_layers, n_heads)."""
    return mean_score(sums, counts).max(dim=1).values


@dataclass
class NeedleBatch(Batch):
    """A batch of needle prompts (probe.needle): which needle key each answer position's target is copied from."""

    sources: Tensor | None = None  # (b, n) long: for query i, the needle position of token i + 1; -1 elsewhere
    correct: Tensor | None = None  # (b, n) bool: the model predicts token i + 1 at i (None: not known yet)


DEFAULT_SINK = 4
DEFAULT_RECENT = 256


def window_keys(queries: Tensor, n_keys: int, sink: int, recent: int) -> Tensor:
    """(len(queries), n_keys) bool: the keys a sink + recent cache keeps for each query position (StreamingLLM,
    Xiao et al. 2023): the first `sink` keys and the `recent` most recent ones, the query's own included."""
    keys = torch.arange(n_keys, device=queries.device)
    before = keys[None, :] <= queries[:, None]
    return before & ((keys[None, :] < sink) | (keys[None, :] > queries[:, None] - recent))


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
    selected = (source >= 0) & correct[:, start:start + block].to(weights.device) & \
        batch.valid[:, start:start + block].to(weights.device)
    if not bool(selected.any()):
        return torch.zeros(h, dtype=torch.float64), torch.zeros(h, dtype=torch.float64)
    rows = selected.nonzero(as_tuple=True)  # (batch index, query) pairs
    top = weights[rows[0], :, rows[1]].argmax(dim=-1)  # (selected, h)
    hits = top == source[rows][:, None]
    return hits.sum(dim=0).double(), torch.full((h,), float(hits.shape[0]), dtype=torch.float64)


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


for _score in (
    Score("previous_token", "natural", 0.5, "attends to the previous token", previous_token_score, "P"),
    Score("sink", "natural", 0.3, "attends to the first token (attention sink)", sink_score, "S"),
    Score("induction", "repeated", 0.4, "attends to the token after the earlier copy of the current one",
          induction_score, "I"),
    Score("duplicate_token", "repeated", 0.4, "attends to the earlier copy of the current token",
          duplicate_token_score, "D"),
    Score("next_token", "natural", 0.5, "attends to the next token (encoders)", next_token_score, "N"),
    Score("positional", "natural", 0.9, "its strongest attention is on one fixed neighbour (Voita et al.)",
          positional_score, "O", finish_positional),
    Score("streaming", "natural", 0.9, "sink + recent keys hold its attention (StreamingLLM's cache, 4 + 256)",
          streaming_score, "W", by_default=False),
    Score("retrieval", "needle", 0.1, "copies the needle token it attends to (Wu et al. 2024)", retrieval_score,
          "R", by_default=False),
):
    register_score(_score)

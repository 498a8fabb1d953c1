"""`HeadVisMetrics`: the six metrics per head, what they were counted over, the data tree's sampled sequences."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from probe.frames import frame, record_rows
from probe.headvis.metrics import METRICS
from probe.schemas.base import Field
from probe.schemas.common import DTYPE, HEAD, HEAD_COLUMNS, LAYER, MODEL, N_HEADS, N_LAYERS, rounded
from probe.schemas.declare import Payload, columns, payload, published, schema_field

UNITS = {"self_attention_score": "attention weight", "prev_token_score": "attention weight",
         "pattern_entropy": "nats", "qk_distance": "positions", "qk_distance_variance": "positions squared",
         "induction_score": "attention weight per repeated query"}  # a head map never compares unlike units


class HeadMetricsEntry(Payload, frozen=True):
    """One head's six metrics."""

    layer: int = schema_field(LAYER)
    head: int = schema_field(HEAD)
    self_attention_score: float | None = schema_field("mean A[i, i] over valid queries", column=True)
    prev_token_score: float | None = schema_field("mean A[i, i - 1] over valid queries past the first", column=True)
    pattern_entropy: float | None = schema_field("mean entropy of a row (nats)", column=True)
    qk_distance: float | None = schema_field("mean |i - j| weighted by attention (positions)", column=True)
    qk_distance_variance: float | None = schema_field("the second moment of |i - j| minus qk_distance squared",
                                                      column=True)
    induction_score: float | None = schema_field(
        "A[i, p + 1] over earlier occurrences p of the query's token (under 0.01 counted 0), per repeated query",
        column=True)


@dataclass
class Sample:
    """One sampled sequence of the data tree: its tokens, and per (layer, head) its rows' largest weights."""

    index: int  # its place among the valid sequences
    tokens: list[str]
    rows: dict[tuple[int, int], tuple[Any, Any]] = field(default_factory=dict)  # (layer, head) -> (values (n, k),
    # keys (n, k)) of its top weights per query row, numpy


@published("headvis", 1, "Neuronpedia HeadVis's six metrics per head: self attention, previous token, entropy, "
           "query-key distance and its variance, induction on the text itself (probe headvis --json).",
           rows="one per head", columns=columns(HEAD_COLUMNS, HeadMetricsEntry))
class HeadVisMetrics(Payload):
    """HeadVis's six metrics per head over a probe set, with the counts they are means over."""

    model: str = schema_field(MODEL)
    n_layers: int = schema_field(N_LAYERS)
    n_heads: int = schema_field(N_HEADS)
    dtype: str = schema_field(DTYPE)
    path: str = schema_field("how the layers were read: the fused backend, or blocked and why")
    probe_set: dict[str, Any] = schema_field("the text the metrics are counted over")
    counts: dict[str, int] = schema_field(
        "valid sequences, valid queries, valid queries past the first, queries with an earlier occurrence",
        fields={"sequences": Field("integer", "sequences of at least two tokens"),
                "queries": Field("integer", "their tokens"),
                "previous": Field("integer", "their tokens past the first"),
                "repeated": Field("integer", "their tokens with an earlier occurrence of the same token")})
    options: dict[str, Any] = schema_field("the options of the run", default_factory=dict, kw_only=True)
    metrics: dict[str, Tensor] = field(default_factory=dict, kw_only=True)  # name -> (n_layers, n_heads)
    max_activation: Tensor | None = field(default=None, kw_only=True)  # (sequences, n_layers, n_heads)
    samples: list[Sample] = field(default_factory=list, kw_only=True)

    @payload("what each metric is measured in", fields={name: Field("string", name) for name in METRICS})
    def units(self) -> dict[str, str]:
        return dict(UNITS)

    @payload("every head", items="one head")
    def heads(self) -> list[HeadMetricsEntry]:
        return [HeadMetricsEntry(layer, head, *(rounded(self.metrics[name][layer, head]) for name in METRICS))
                for layer in range(self.n_layers) for head in range(self.n_heads)]

    def to_frame(self) -> Any:
        """A pandas DataFrame, one row per head: layer, head, name and the six metrics. Needs pandas."""
        return frame(record_rows(self.heads))

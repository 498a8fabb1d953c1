"""`HeadMap`: one number per (layer, head) with its convention stated (query head `q` reads KV head
`q // (n_heads // n_kv_heads)`); conversions are explicit (`to_kv`, `to_query`), never silent."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from probe.errors import ProbeError

QUERY, KV = "query", "kv"

GROUPINGS = ("max", "min", "mean")


@dataclass(frozen=True)
class HeadMap:
    """Values per (layer, head) of one map file (NaN where none), its `convention` (QUERY or KV) and any `labels`."""

    values: np.ndarray
    convention: str
    source: str
    format: str
    score: str
    n_heads: int | None = None  # query heads per layer, where the file says
    n_kv_heads: int | None = None  # KV heads per layer, where the file says (the grouping)
    dtype: str | None = None  # what the run that made it computed in, where the file says
    model: str | None = None
    labels: np.ndarray | None = None
    label_name: str | None = None  # what a label means: "full", "induction", "score > 0.1"
    threshold: float | None = None  # the threshold the labels came from, where they came from one
    quantity: str | None = None  # what a value measures, as its format declares it ("induction score"); None: unsaid
    unit: str | None = None  # the unit of a value, in words ("score, 0 to 1"), where the format knows it
    signed: bool = False  # the format's values may be negative (a loss change): drawn on a scale centred on 0

    def __post_init__(self) -> None:
        if self.values.ndim != 2 or 0 in self.values.shape:
            raise ProbeError(f"{self.source}: a head map is a non-empty layers x heads matrix, got shape "
                             f"{tuple(self.values.shape)}")

    @property
    def n_layers(self) -> int:
        return int(self.values.shape[0])

    @property
    def columns(self) -> int:
        """Heads per layer in this map's own convention."""
        return int(self.values.shape[1])

    def describe(self) -> str:
        """`30 layers x 3 KV heads`: the shape in words, for messages and reports."""
        unit = "KV heads" if self.convention == KV else "query heads"
        return f"{self.n_layers} layers x {self.columns} {unit}"

    def with_labels(self, threshold: float) -> HeadMap:
        """The labelled set as the heads whose value is above `threshold` (replacing the format's own labels)."""
        with np.errstate(invalid="ignore"):
            labels = self.values > threshold
        return replace(self, labels=labels, label_name=f"{self.score} > {threshold:g}", threshold=threshold)

    def to_kv(self, group: str, n_kv_heads: int) -> HeadMap:
        """This query-head map over KV heads: `group` (max, min, mean) over each KV head's query heads, labels alike."""
        if group not in GROUPINGS:
            raise ProbeError(f"group {group!r}: use one of {', '.join(GROUPINGS)}", parameter="group")
        if self.convention != QUERY:
            raise ProbeError(f"{self.source} is already a KV-head map: group only a query-head map")
        size = _group_size(self, n_kv_heads)
        blocks = self.values.reshape(self.n_layers, n_kv_heads, size)
        with np.errstate(invalid="ignore"):
            values = blocks.max(axis=2) if group == "max" else blocks.min(axis=2) if group == "min" else \
                blocks.mean(axis=2)
        labels = None
        if self.labels is not None:
            marks = self.labels.reshape(self.n_layers, n_kv_heads, size)
            labels = {"max": marks.any(axis=2), "min": marks.all(axis=2), "mean": marks.mean(axis=2) > 0.5}[group]
        return replace(self, values=values.astype(np.float64), convention=KV, labels=labels,
                       n_heads=self.columns, n_kv_heads=n_kv_heads)

    def to_query(self, n_heads: int) -> HeadMap:
        """This KV-head map over query heads: each takes its KV head's value and label, as `repeat_kv` hands it keys."""
        if self.convention != KV:
            raise ProbeError(f"{self.source} is already a query-head map: expand only a KV-head map")
        if n_heads % self.columns:
            raise ProbeError(f"{self.source} has {self.columns} KV heads per layer, which do not divide {n_heads} "
                             "query heads: the maps are of different models")
        size = n_heads // self.columns
        labels = None if self.labels is None else np.repeat(self.labels, size, axis=1)
        return replace(self, values=np.repeat(self.values, size, axis=1), convention=QUERY, labels=labels,
                       n_heads=n_heads, n_kv_heads=self.columns)

    def same_kind(self, other: HeadMap) -> bool:
        """Whether `other` holds the same kind of score: both formats declare the same quantity."""
        return self.quantity is not None and self.quantity == other.quantity

    def has_sign(self) -> bool:
        """Signed values: the format says so, or a value is negative."""
        finite = self.values[np.isfinite(self.values)]
        return self.signed or bool(finite.size and finite.min() < 0)

    def facts(self) -> dict[str, Any]:
        """What the file said about itself, for a comparison's payload."""
        return {"source": self.source, "format": self.format, "score": self.score, "convention": self.convention,
                "n_layers": self.n_layers, "columns": self.columns, "n_heads": self.n_heads,
                "n_kv_heads": self.n_kv_heads, "dtype": self.dtype, "model": self.model,
                "label_name": self.label_name if self.labels is not None else None, "threshold": self.threshold,
                "quantity": self.quantity, "unit": self.unit, "signed": self.has_sign()}


def _group_size(query: HeadMap, n_kv_heads: int) -> int:
    """Query heads per KV head; refused where the file's own grouping disagrees or the counts do not divide."""
    if query.n_kv_heads is not None and query.n_kv_heads != n_kv_heads:
        raise ProbeError(f"{query.source} groups its {query.columns} query heads into {query.n_kv_heads} KV heads, "
                         f"not {n_kv_heads}: the maps are of different models")
    if n_kv_heads < 1 or query.columns % n_kv_heads:
        raise ProbeError(f"{query.source} has {query.columns} query heads per layer, which {n_kv_heads} KV heads "
                         "do not divide: the maps are of different models")
    return query.columns // n_kv_heads

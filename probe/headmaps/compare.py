"""`compare(a, b)`: two head maps side by side (two models' checkpoints, two dtypes, probe against a published map):
per-head difference b - a, Spearman and Pearson correlation, overlap of the top-k and of the labelled sets, and the
heads that moved most. Maps of different conventions (query heads against KV heads) are compared only after an
explicit conversion (`group` or `expand`); anything else of another shape is refused in one line.

A difference b - a is taken only between maps of the same kind of score, as each map's format declares it
(`HeadMap.quantity`: an attention share minus a loss change means nothing); other maps are compared by rank (the
`measure` "ranks": rank B - rank A per head), unless the caller declares them the same kind (`same_kind`, for files
that do not say what they hold, such as tensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from probe.errors import ProbeError
from probe.frames import frame, head_columns
from probe.headmaps.maps import KV, QUERY, HeadMap

TOP_K = 10  # heads in each map's top set
MOVERS = 15  # largest differences listed


def align(a: HeadMap, b: HeadMap, *, group: str | None = None, expand: bool = False) -> tuple[HeadMap, HeadMap, str]:
    """`a` and `b` over the same heads, and what was converted ("" where nothing was): a query-head map against a
    KV-head map needs `group` (query -> KV) or `expand` (KV -> query)."""
    if group is not None and expand:
        raise ProbeError("group and expand are two ways of one conversion: give one of them", parameter="group")
    if a.n_layers != b.n_layers:
        raise ProbeError(f"A has {a.n_layers} layers, B {b.n_layers}: maps of different models cannot be compared")
    if a.convention == b.convention or (a.columns == b.columns and group is None and not expand):
        if a.columns != b.columns:
            raise ProbeError(f"A is {a.describe()}, B {b.describe()}: maps of different shapes cannot be compared")
        return a, b, ""
    query, kv = (a, b) if a.convention == QUERY else (b, a)
    if group is not None:
        grouped = query.to_kv(group, kv.columns)
        how = f"query heads -> KV heads: the {group} over each KV head's {query.columns // kv.columns} query heads"
        return (grouped, kv, how) if query is a else (kv, grouped, how)
    if expand:
        expanded = kv.to_query(query.columns)
        how = f"KV heads -> query heads: each query head takes its KV head's value ({query.columns // kv.columns} " \
              "query heads per KV head)"
        return (query, expanded, how) if query is a else (expanded, query, how)
    raise ProbeError(f"A is {a.describe()}, B {b.describe()}: pass group (max, min or mean: query heads -> KV heads) "
                     "or expand (each query head takes its KV head's value)", parameter="group")


def ranks(values: np.ndarray) -> np.ndarray:
    """Ranks 1..n of `values`, ties sharing their mean rank (Spearman's convention)."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    result = np.empty(len(values))
    start = 0
    while start < len(values):
        end = start
        while end + 1 < len(values) and ordered[end + 1] == ordered[start]:
            end += 1
        result[order[start:end + 1]] = (start + end) / 2 + 1
        start = end + 1
    return result


def _pearson(x: np.ndarray, y: np.ndarray) -> float | None:
    """Pearson's r, or None where it is undefined (fewer than two heads, or a map constant over them)."""
    if len(x) < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return None
    return float(np.corrcoef(x, y)[0, 1])


def _top(values: np.ndarray, valid: np.ndarray, k: int) -> set[tuple[int, int]]:
    """The k heads of largest value among the valid ones (ties: the earlier head)."""
    cells = [(float(values[cell]), cell) for cell in zip(*np.nonzero(valid))]
    cells.sort(key=lambda item: (-item[0], item[1]))
    return {(int(layer), int(head)) for _, (layer, head) in cells[:k]}


def _cells(mask: np.ndarray) -> set[tuple[int, int]]:
    return {(int(layer), int(head)) for layer, head in np.argwhere(mask)}


def _overlap(first: set[tuple[int, int]], second: set[tuple[int, int]]) -> dict[str, Any]:
    """Count and Jaccard index of two head sets, and the heads of each alone."""
    union = first | second
    return {"count": len(first & second), "jaccard": len(first & second) / len(union) if union else None,
            "both": sorted(map(list, first & second)), "only_a": sorted(map(list, first - second)),
            "only_b": sorted(map(list, second - first))}


def _labelled(a: HeadMap, b: HeadMap, threshold: tuple[float, float] | None) -> tuple[HeadMap, HeadMap]:
    """The maps with the labels compared: their own, or each above its threshold where thresholds are given."""
    if threshold is None:
        return a, b
    return a.with_labels(threshold[0]), b.with_labels(threshold[1])


DIFFERENCE, RANKS = "difference", "ranks"
"""How a comparison sets B against A per head: b - a (the same kind of score), or rank B - rank A."""


def measure(a: HeadMap, b: HeadMap, same_kind: bool) -> str:
    """DIFFERENCE where both formats declare the same quantity, or the caller declares it (`same_kind`) for maps
    that do not say; RANKS otherwise. Declaring two declared, different quantities the same is refused."""
    if a.same_kind(b):
        return DIFFERENCE
    if not same_kind:
        return RANKS
    if a.quantity is not None and b.quantity is not None:
        raise ProbeError(f"A holds {a.quantity}, B {b.quantity}: different kinds of score, compared by rank; drop "
                         "same_kind", parameter="same_kind")
    return DIFFERENCE


def compare(a: HeadMap, b: HeadMap, *, top_k: int = TOP_K, group: str | None = None, expand: bool = False,
            threshold: tuple[float, float] | None = None, movers: int = MOVERS, same_kind: bool = False) -> Comparison:
    """Compare two head maps head by head after an explicit conversion where their conventions differ: b - a
    where they hold the same kind of score (`measure`), their ranks otherwise."""
    if top_k < 1:
        raise ProbeError(f"top_k must be at least 1, got {top_k}", parameter="top_k")
    how = measure(a, b, same_kind)
    a, b, conversion = align(a, b, group=group, expand=expand)
    a, b = _labelled(a, b, threshold)
    valid = np.isfinite(a.values) & np.isfinite(b.values)
    if not valid.any():
        raise ProbeError("A and B have no head with a value in both: nothing to compare")
    x, y = a.values[valid], b.values[valid]
    k = min(top_k, int(valid.sum()))
    labels = None
    if a.labels is not None and b.labels is not None:
        labels = _overlap(_cells(a.labels & valid), _cells(b.labels & valid))
        labels.update(a=a.label_name, b=b.label_name, count_a=int((a.labels & valid).sum()),
                      count_b=int((b.labels & valid).sum()))
    differs = how == DIFFERENCE
    statistics = {"heads": int(valid.sum()), "spearman": _pearson(ranks(x), ranks(y)), "pearson": _pearson(x, y),
                  "mean_abs_difference": float(np.abs(y - x).mean()) if differs else None,
                  "max_abs_difference": float(np.abs(y - x).max()) if differs else None,
                  "top_k": {"k": k, **_overlap(_top(a.values, valid, k), _top(b.values, valid, k))},
                  "labelled": labels}
    return Comparison(a, b, conversion, valid, statistics, movers, how)


@dataclass
class Comparison:
    """Two head maps over the same heads, and how they differ (`to_dict()`, `to_frame()`)."""

    a: HeadMap
    b: HeadMap
    conversion: str  # "" where the maps were compared as read
    valid: np.ndarray  # heads with a value in both
    statistics: dict[str, Any]
    movers: int = MOVERS
    measure: str = DIFFERENCE  # DIFFERENCE: the same kind of score; RANKS: rank B - rank A only

    @property
    def difference(self) -> np.ndarray:
        """b - a per head (NaN where either has no value), whatever the maps hold: `measure` says whether it
        means anything."""
        return self.b.values - self.a.values

    def rows(self) -> list[dict[str, Any]]:
        """One row per head: layer, head, a, b, difference (None unless the maps are of one kind), each map's rank
        (1: largest), rank B - rank A, and each map's label."""
        rank = {}
        for name, values in (("a", self.a.values), ("b", self.b.values)):
            cells = sorted(((int(layer), int(head)) for layer, head in np.argwhere(self.valid)),
                           key=lambda cell: (-values[cell], cell))  # `values`: used within this iteration
            rank[name] = {cell: index + 1 for index, cell in enumerate(cells)}
        rows = []
        for layer, head in np.ndindex(*self.valid.shape):
            a, b = self.a.values[layer, head], self.b.values[layer, head]
            rank_a, rank_b = rank["a"].get((layer, head)), rank["b"].get((layer, head))
            rows.append({"layer": layer, "head": head, "a": _number(a), "b": _number(b),
                         "difference": _number(b - a) if self.measure == DIFFERENCE else None,
                         "rank_a": rank_a, "rank_b": rank_b,
                         "rank_difference": None if rank_a is None or rank_b is None else rank_b - rank_a,
                         "label_a": _label(self.a, layer, head), "label_b": _label(self.b, layer, head)})
        return rows

    def to_dict(self) -> dict[str, Any]:
        rows = self.rows()
        key = "difference" if self.measure == DIFFERENCE else "rank_difference"
        moved = sorted((row for row in rows if row[key] is not None),
                       key=lambda row: (-abs(row[key]), row["layer"], row["head"]))
        dtypes = {"a": self.a.dtype, "b": self.b.dtype}
        return {"kind": "compare", "measure": self.measure, "a": self.a.facts(), "b": self.b.facts(),
                "conversion": self.conversion,
                "convention": self.a.convention, "n_layers": self.a.n_layers, "heads_per_layer": self.a.columns,
                "dtype": self.a.dtype if self.a.dtype == self.b.dtype else None, "dtypes": dtypes,
                **self.statistics, "movers": moved[:self.movers], "rows": rows}

    def to_frame(self) -> Any:
        """A pandas DataFrame, one row per head (schema `compare`'s frame_row): layer, head, name, a, b, difference,
        ranks and labels. The name is frames' `L5H1` over query heads, `L5KV1` over KV heads (a KV head is no query
        head, and a table must not say it is). Needs pandas."""
        rows = [{**head_columns(row["layer"], row["head"]), **row} for row in self.rows()]
        if self.a.convention == KV:
            for row in rows:
                row["name"] = f"L{row['layer']}KV{row['head']}"
        return frame(rows)

    def __repr__(self) -> str:
        stats = self.statistics
        spearman = "n/a" if stats["spearman"] is None else f"{stats['spearman']:.3f}"
        return (f"Comparison({self.a.source!r} vs {self.b.source!r}: {self.a.describe()}, Spearman {spearman}, "
                f"top-{stats['top_k']['k']} overlap {stats['top_k']['count']})")


def _number(value: float) -> float | None:
    return None if not np.isfinite(value) else round(float(value), 6)


def _label(head_map: HeadMap, layer: int, head: int) -> bool | None:
    return None if head_map.labels is None else bool(head_map.labels[layer, head])


"""`compare(a, b)`: two head maps side by side; query-head and KV-head maps only after an explicit `group` or
`expand`, a difference only between maps of the same kind of score (others by rank)."""

from __future__ import annotations

from typing import Any

import numpy as np

from probe.errors import ProbeError
from probe.frames import frame, head_columns
from probe.headmaps.maps import KV, QUERY, HeadMap
from probe.schemas.base import Field
from probe.schemas.common import LAYER, N_LAYERS, rounded
from probe.schemas.declare import Payload, payload, published, schema_field

TOP_K = 10  # heads in each map's top set
MOVERS = 15  # largest differences listed


def align(a: HeadMap, b: HeadMap, *, group: str | None = None, expand: bool = False) -> tuple[HeadMap, HeadMap, str]:
    """`a` and `b` over the same heads, and what was converted; query against KV heads needs `group` or `expand`."""
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
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)  # a tie group's sorted places: ends - counts .. ends - 1
    return ((2 * ends - counts - 1) / 2 + 1)[inverse.reshape(-1)]


def _pearson(x: np.ndarray, y: np.ndarray) -> float | None:
    """Pearson's r, or None where it is undefined (fewer than two heads, or a map constant over them)."""
    if len(x) < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return None
    return float(np.corrcoef(x, y)[0, 1])


def _ranked(values: np.ndarray, valid: np.ndarray) -> list[tuple[int, int]]:
    """The valid heads, largest value first (ties: the earlier head)."""
    cells = [(int(layer), int(head)) for layer, head in np.argwhere(valid)]
    return sorted(cells, key=lambda cell: (-values[cell], cell))


def _cells(mask: np.ndarray) -> set[tuple[int, int]]:
    return {(int(layer), int(head)) for layer, head in np.argwhere(mask)}


def _overlap(first: set[tuple[int, int]], second: set[tuple[int, int]]) -> dict[str, Any]:
    """Count and Jaccard index of two head sets, and the heads of each alone."""
    union = first | second
    return {"count": len(first & second), "jaccard": len(first & second) / len(union) if union else None,
            "both": sorted(map(list, first & second)), "only_a": sorted(map(list, first - second)),
            "only_b": sorted(map(list, second - first))}


DIFFERENCE, RANKS = "difference", "ranks"  # how B is set against A per head: b - a, or rank B - rank A


def measure(a: HeadMap, b: HeadMap, same_kind: bool) -> str:
    """DIFFERENCE where both declare the same quantity (or `same_kind` for maps that do not say), else RANKS."""
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
    """Compare two head maps head by head: b - a where they hold the same kind of score (`measure`), ranks otherwise."""
    if top_k < 1:
        raise ProbeError(f"top_k must be at least 1, got {top_k}", parameter="top_k")
    how = measure(a, b, same_kind)
    a, b, conversion = align(a, b, group=group, expand=expand)
    if threshold is not None:  # the labels compared: each map's own, or those above its threshold
        a, b = a.with_labels(threshold[0]), b.with_labels(threshold[1])
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
                  "top_k": {"k": k, **_overlap(set(_ranked(a.values, valid)[:k]), set(_ranked(b.values, valid)[:k]))},
                  "labelled": labels}
    return Comparison(a, b, conversion, valid, statistics, movers, measure=how)


MAP_HEAD = Field("integer", "the head within its layer: a query head, or a KV head where `convention` is kv")
CELLS = Field("array", "heads as [layer, head], in order", items=Field("array", "[layer, head]",
                                                                        items=Field("integer", "layer, then head")))
OVERLAP = {"count": Field("integer", "heads in both sets"),
           "jaccard": Field("number", "count / heads in either set (undefined where both sets are empty)"),
           "both": CELLS, "only_a": CELLS, "only_b": CELLS}
MAP_FACTS = {
    "source": Field("string", "the file (or DuoAttention folder) as given"),
    "format": Field("string", "the head-map format that read it (docs/compare.md: duo, probe-classify, tensor, ...)"),
    "score": Field("string", "the score read from it (a class, retrieval, full_attention, value, ...)"),
    "convention": Field("string", "what a column is after any conversion: query (heads) or kv (heads)"),
    "n_layers": Field("integer", "layers of the map"),
    "columns": Field("integer", "heads per layer in its convention"),
    "n_heads": Field(("integer", "null"), "query heads per layer, where the file says"),
    "n_kv_heads": Field(("integer", "null"), "KV heads per layer, where the file says"),
    "dtype": Field(("string", "null"), "the dtype of the run that made it, where the file says"),
    "model": Field(("string", "null"), "the model it was made from, where the file says"),
    "label_name": Field(("string", "null"), "what its labelled heads are (full, induction, value > 0.5); null: no "
                                            "labels"),
    "threshold": Field("number", "the threshold its labels came from (null: none)"),
    "quantity": Field(("string", "null"), "what a value measures, as its format declares it (null: the file does "
                                          "not say, as a tensor's)"),
    "unit": Field(("string", "null"), "the unit of a value, where the format knows it"),
    "signed": Field("boolean", "whether its values may be negative (drawn on a scale centred on 0)"),
}
COMPARE_ROW = {
    "layer": LAYER, "head": MAP_HEAD, "a": Field("number", "A's value (null: A has none)"),
    "b": Field("number", "B's value (null: B has none)"),
    "difference": Field("number", "b - a, rounded to 6 places (null where measure is ranks)"),
    "rank_a": Field(("integer", "null"), "the head's rank in A (1: largest) among the heads both maps have"),
    "rank_b": Field(("integer", "null"), "its rank in B"),
    "rank_difference": Field(("integer", "null"), "rank_b - rank_a (negative: B ranks it higher)"),
    "label_a": Field(("boolean", "null"), "whether A labels it (null: A has no labels)"),
    "label_b": Field(("boolean", "null"), "whether B labels it (null: B has no labels)"),
}

STATISTICS = {
    "heads": Field("integer", "heads with a value in both maps: every statistic is over these"),
    "spearman": Field("number", "Spearman's rank correlation (ties share their mean rank; undefined where a "
                                "map is constant or fewer than two heads)"),
    "pearson": Field("number", "Pearson's correlation (undefined as Spearman's)"),
    "mean_abs_difference": Field("number", "mean |b - a| (null where measure is ranks)"),
    "max_abs_difference": Field("number", "max |b - a| (null where measure is ranks)"),
    "top_k": Field("object", "the overlap of each map's k largest heads", fields={
        "k": Field("integer", "the top set's size (--top, at most `heads`)"), **OVERLAP}),
    "labelled": Field(("object", "null"), "the overlap of the labelled heads (null unless both maps have labels: "
                                          "their own, or --threshold's)", fields={
        **OVERLAP, "a": Field(("string", "null"), "what A's labels are"),
        "b": Field(("string", "null"), "what B's labels are"),
        "count_a": Field("integer", "heads A labels"), "count_b": Field("integer", "heads B labels")}),
}
"""What `compare` measures over the heads both maps have (`Comparison.statistics`)."""


@published("compare", 1, "Two head maps over the same heads (after an explicit conversion where one is over query "
           "heads, the other over KV heads): per-head difference B - A, rank and linear correlation, top-k and "
           "labelled overlaps, the heads that moved most (probe compare --json).",
           rows="one per head compared, layer by layer",
           columns={"layer": LAYER, "head": MAP_HEAD, "name": Field(
               "string", "the head's name for a table: L18H6 over query heads, L5KV1 over KV heads (a KV head is no "
               "query head)"), **{name: entry for name, entry in COMPARE_ROW.items() if name not in ("layer", "head")}})
class Comparison(Payload):
    """Two head maps over the same heads, and how they differ (`to_dict()`, `to_frame()`)."""

    @payload("compare")
    def kind(self) -> str:
        return "compare"

    measure: str = schema_field(  # DIFFERENCE: the same kind of score; RANKS: rank B - rank A only
        "difference (b - a: both maps hold the same kind of score) or ranks (rank B - rank A: different kinds, whose "
        "difference would mean nothing)", default=DIFFERENCE, kw_only=True)
    a: HeadMap = schema_field("map A as read", type="object", fields=MAP_FACTS, dump=HeadMap.facts)
    b: HeadMap = schema_field("map B as read", type="object", fields=MAP_FACTS, dump=HeadMap.facts)
    conversion: str = schema_field(  # "" where the maps were compared as read
        "how one map was converted to the other's heads ('' where none was)")
    valid: np.ndarray  # heads with a value in both
    statistics: dict[str, Any]
    movers: int = MOVERS

    @payload("the heads compared: query or kv")
    def convention(self) -> str:
        return self.a.convention

    @payload(N_LAYERS.description)
    def n_layers(self) -> int:
        return self.a.n_layers

    @payload("heads per layer compared (query or KV heads, per `convention`)")
    def heads_per_layer(self) -> int:
        return self.a.columns

    @payload("the dtype both maps were computed in (null where they differ or neither file says: see dtypes)")
    def dtype(self) -> str | None:
        return self.a.dtype if self.a.dtype == self.b.dtype else None

    @payload("each map's dtype, where its file says", fields={"a": Field(("string", "null"), "A's"),
                                                             "b": Field(("string", "null"), "B's")})
    def dtypes(self) -> dict[str, str | None]:
        return {"a": self.a.dtype, "b": self.b.dtype}

    @payload("the statistics over the heads both maps have", spread=True, fields=STATISTICS)
    def measured(self) -> dict[str, Any]:
        return self.statistics

    @payload("the heads of largest |difference| (|rank_difference| where measure is ranks), largest first (15 at "
             "most)", key="movers", items=Field("object", "a head, as in rows", fields=COMPARE_ROW))
    def moved(self) -> list[dict[str, Any]]:
        key = "difference" if self.measure == DIFFERENCE else "rank_difference"
        moved = sorted((row for row in self.rows if row[key] is not None),
                       key=lambda row: (-abs(row[key]), row["layer"], row["head"]))
        return moved[:self.movers]

    @payload("every head, layer by layer", items=Field("object", "a head", fields=COMPARE_ROW))
    def rows(self) -> list[dict[str, Any]]:
        """One row per head: its values, difference, each map's rank (1: largest), rank difference and labels."""
        rank = {name: {cell: index + 1 for index, cell in enumerate(_ranked(values, self.valid))}
                for name, values in (("a", self.a.values), ("b", self.b.values))}
        rows = []
        for layer, head in np.ndindex(*self.valid.shape):
            a, b = self.a.values[layer, head], self.b.values[layer, head]
            rank_a, rank_b = rank["a"].get((layer, head)), rank["b"].get((layer, head))
            rows.append({"layer": layer, "head": head, "a": rounded(a), "b": rounded(b),
                         "difference": rounded(b - a) if self.measure == DIFFERENCE else None,
                         "rank_a": rank_a, "rank_b": rank_b,
                         "rank_difference": None if rank_a is None or rank_b is None else rank_b - rank_a,
                         "label_a": _label(self.a, layer, head), "label_b": _label(self.b, layer, head)})
        return rows

    @property
    def difference(self) -> np.ndarray:
        """b - a per head (NaN where either has no value): `measure` says whether it means anything."""
        return self.b.values - self.a.values

    def to_frame(self) -> Any:
        """A pandas DataFrame, one row per head (`L5KV1` over KV heads): the compare frame_row. Needs pandas."""
        rows = [{**head_columns(row["layer"], row["head"]), **row} for row in self.rows]
        if self.a.convention == KV:
            for row in rows:
                row["name"] = f"L{row['layer']}KV{row['head']}"
        return frame(rows)

    def __repr__(self) -> str:
        stats = self.statistics
        spearman = "n/a" if stats["spearman"] is None else f"{stats['spearman']:.3f}"
        return (f"Comparison({self.a.source!r} vs {self.b.source!r}: {self.a.describe()}, Spearman {spearman}, "
                f"top-{stats['top_k']['k']} overlap {stats['top_k']['count']})")


def _label(head_map: HeadMap, layer: int, head: int) -> bool | None:
    return None if head_map.labels is None else bool(head_map.labels[layer, head])


"""Results of a sweep: one HeadResult per ablation, gathered in an AblationResult with its baseline and provenance."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from probe.ablation.heads import Ablation, Head, column_name, label
from probe.ablation.metrics import METRICS, losses
from probe.errors import ProbeError
from probe.frames import frame
from probe.schemas.base import Field
from probe.schemas.common import DTYPE, HEAD, LAYER, LAYER_NAMES, MODEL, N_HEADS, N_LAYERS
from probe.schemas.declare import Payload, payload, published, schema_field


EFFECT_COLUMNS = ("mean_delta", "max_sequence_delta", "p99_token_delta", "max_token_delta", "specificity")
"""The scalar per-token effects, one CSV column each (the top tokens stay in the JSON)."""


@dataclass
class HeadResult:
    """The metric with one head ablated (or several together: `heads`)."""

    heads: Ablation
    loss: float
    delta: float
    parts: dict[str, float] = field(default_factory=dict)  # e.g. first_repeat / second_repeat losses
    part_deltas: dict[str, float] = field(default_factory=dict)
    exact: bool | None = None  # estimate mode: True for the heads that were ablated exactly
    effects: dict[str, Any] = field(default_factory=dict)  # per-token and per-sequence effects (ablation.effects)
    task: dict[str, float] = field(default_factory=dict)  # task sets: margin and accuracy with the head ablated

    @property
    def layer(self) -> int:
        return self.heads[0][0]

    @property
    def head(self) -> int:
        return self.heads[0][1]

    @staticmethod
    def of_sums(ablation: Ablation, sums: Tensor, counts: Tensor, baseline_loss: float,
                baseline_parts: dict[str, float], exact: bool | None = None) -> HeadResult:
        """The result of an ablation from its (parts + 1,) metric sums and the positions that count."""
        loss, parts = losses(sums, counts, list(baseline_parts))
        return HeadResult(ablation, loss, loss - baseline_loss, parts,
                          {name: parts[name] - baseline_parts[name] for name in baseline_parts}, exact)

    def to_dict(self, layer_names: list[str] | None = None) -> dict[str, Any]:
        entry: dict[str, Any] = {}
        if len(self.heads) == 1:
            entry.update(layer=self.layer, head=self.head)
        else:
            entry.update(heads=[list(head) for head in self.heads], label=label(self.heads, layer_names))
        entry.update(loss=self.loss, delta=self.delta)
        for name, value in self.parts.items():
            entry[f"{name}_loss"] = value
            entry[f"{name}_delta"] = self.part_deltas.get(name)
        if self.exact is not None:
            entry["exact"] = self.exact
        entry.update({f"task_{name}": value for name, value in self.task.items()})
        if self.effects:
            entry["effects"] = self.effects
        return entry

    @staticmethod
    def from_dict(entry: Any) -> HeadResult:
        """The result `to_dict` wrote; ProbeError saying what is missing or wrong in a malformed entry (a value of
        another type is refused, not converted: a head 1.5 read as 1, or a loss "2", would be silently wrong)."""
        if not isinstance(entry, dict):
            raise ProbeError(f"an ablation entry is a JSON object, not {type(entry).__name__}")
        try:
            pairs = [(entry["layer"], entry["head"])] if "layer" in entry else list(entry["heads"])
            heads = tuple((_index(a), _index(b)) for a, b in pairs)
            loss, delta = _number(entry["loss"]), _number(entry["delta"])
        except KeyError as error:
            raise ProbeError(f"the ablation entry has no {error.args[0]!r}") from None
        except (TypeError, ValueError) as error:
            raise ProbeError(f"the ablation entry has a malformed value ({error})") from None
        if not heads:
            raise ProbeError("the ablation entry names no head")
        parts = {key[:-5]: _optional(value) for key, value in entry.items() if key.endswith("_loss") and key != "loss"}
        deltas = {key[:-6]: _optional(value) for key, value in entry.items()
                  if key.endswith("_delta") and key != "delta"}
        task = {key[5:]: _optional(value) for key, value in entry.items() if key.startswith("task_")}
        exact, effects = entry.get("exact"), entry.get("effects") or {}
        if exact not in (None, True, False) or not isinstance(effects, dict):
            raise ProbeError("the ablation entry has a malformed value (exact or effects)")
        # a part or task value that was not finite was written as null: it is read back as None
        return HeadResult(heads, loss, delta, parts, deltas, exact, effects, task)  # type: ignore[arg-type]


def _index(value: Any) -> int:
    """A layer or head number as JSON holds it: an int, not a bool, a float or a string."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a layer or head number")
    return value


def _number(value: Any) -> float:
    """A loss as JSON holds it: a number (NaN and infinity included), not a string or a bool."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{value!r} is not a number")
    return float(value)


def _optional(value: Any) -> float | None:
    if value is None:
        return None
    try:
        return _number(value)
    except ValueError as error:
        raise ProbeError(f"the ablation entry has a malformed value ({error})") from None


PART_RE = r"^(?!(loss|delta|baseline_loss|first_order|second_order)$).+_(loss|delta)$"
ABLATION_ENTRY = {
    "loss": Field("number", "the metric with the head (or heads) ablated"),
    "delta": Field("number", "loss minus the baseline: > 0, the head helps"),
    "exact": Field("boolean", "estimate mode: true where the head was ablated for real", required=False),
    "effects": Field("object", "per-token and per-sequence effects: mean, max per sequence, p99 and max per token, "
                               "specificity, the top tokens in context", required=False),
    "first_order": Field("number", "estimate mode: the first-order term", required=False),
    "second_order": Field("number", "estimate mode: the second-order term", required=False),
}
"""The fields of `HeadResult.to_dict()` (and the estimate's terms, `AblationResult.head_entries`) besides its
heads: the entries differ in their heads (a head's `layer` and `head`, a group's `heads` and `label`)."""
ABLATION_PATTERNS = {PART_RE: Field("number", "a part's loss (PART_loss) or its change (PART_delta): e.g. "
                                              "second_repeat_loss on a repeated set"),
                     r"^task_": Field("number", "task sets: the margin or accuracy with the head ablated")}


@published("ablate", 1, "The metric with each head (and each group of heads) ablated, against the baseline (probe "
           "ablate --json).", rows="one per ablation (a head, or a group: layer and head null), largest delta first",
        columns={"layer": Field(("integer", "null"), "the head's layer (null for a group)"),
                 "head": Field(("integer", "null"), "the head (null for a group)"),
                 "name": Field("string", "L18H6, or L5H1+L18H6 for a group"),
                 "loss": ABLATION_ENTRY["loss"], "delta": ABLATION_ENTRY["delta"],
                 "value": Field("string", "estimate mode: exact or estimated", required=False)},
        column_patterns={**ABLATION_PATTERNS, r"^(mean_delta|max_sequence_delta|p99_token_delta|max_token_delta|"
                                              r"specificity)$": Field("number",
                                                                      "a per-token effect (ablation.effects)")})
class AblationResult(Payload):
    """Baseline and ablated metric of every ablation of a sweep, plus how it was computed."""

    model: str = schema_field(MODEL)
    method: str = schema_field("the ablation: zero, mean, window, ...")  # "zero" or "mean"
    data: str = schema_field("what the metric was measured on: natural, repeated, a text file, a task")
    metric: str = schema_field("the metric's name")  # a key of METRICS

    @payload("what it measures")
    def metric_description(self) -> str:
        metric = METRICS.get(self.metric)
        return metric.description if metric is not None else self.metric

    baseline_loss: float = schema_field("the metric with nothing ablated")
    results: list[HeadResult]

    @payload("one entry per head ablated alone", key="heads", type="array", items=Field(
        "object", "one head", fields={"layer": LAYER, "head": HEAD, **ABLATION_ENTRY}, patterns=ABLATION_PATTERNS))
    def head_entries(self) -> list[dict[str, Any]]:
        """Each single head's entry (`HeadResult.to_dict()`, with the estimate's terms where it has them)."""
        return [self._entry(r) for r in self.heads]

    n_layers: int = schema_field(N_LAYERS)
    n_heads: int = schema_field(N_HEADS)
    mode: str = schema_field("exact, naive or estimate", default="exact", kw_only=True)
    path: str = schema_field("how the numbers were computed", default="", kw_only=True)
    dtype: str = schema_field(DTYPE, default="float32", kw_only=True)  # docs/precision.md: how far half precision lies
    layer_names: list[str] | None = schema_field(LAYER_NAMES, default=None, kw_only=True)  # probe.hooks.stacks
    baseline_parts: dict[str, float] = field(default_factory=dict, kw_only=True)

    @payload("each part's baseline loss", spread=True, patterns={
        r"^baseline_.+_loss$": Field("number", "a part's baseline loss, e.g. baseline_second_repeat_loss")})
    def baseline_part_losses(self) -> dict[str, float]:
        return {f"baseline_{name}_loss": value for name, value in self.baseline_parts.items()}

    @payload("heads ablated together", key="groups", required=False, type="array", items=Field(
        "object", "one group", fields={"heads": Field("array", "its heads as [layer, head]"),
                                       "label": Field("string", "its name, e.g. 5.1+18.6"), **ABLATION_ENTRY},
        patterns=ABLATION_PATTERNS))
    def group_entries(self) -> list[dict[str, Any]]:
        return [r.to_dict(self.layer_names) for r in self.groups]

    mean: str | None = schema_field("mean ablation: what the means were taken over", required=False, omit="none",
                                    default=None, kw_only=True)
    probe_set: dict[str, Any] = schema_field("the probe set's description", required=False, default_factory=dict,
                                             kw_only=True)
    seconds: float | None = schema_field("wall time of the sweep", required=False, default=None, kw_only=True,
                                         dump=lambda seconds: round(seconds, 3))
    forwards: float | None = schema_field(  # cost in forward-pass equivalents (estimate mode)
        "estimate mode: cost in forward passes", key="forward_equivalents", required=False, default=None,
        kw_only=True, dump=lambda forwards: round(forwards, 3))
    task: dict[str, float] | None = schema_field(  # task sets: the unablated model's margin and accuracy
        "task sets: the unablated model's margin and accuracy", key="baseline_task", required=False, omit="none",
        default=None, kw_only=True)
    terms: dict[Head, tuple[float, float]] | None = field(  # estimate mode: (first-order, second-order) per head
        default=None, kw_only=True)

    @property
    def heads(self) -> list[HeadResult]:
        """Single-head results."""
        return [r for r in self.results if len(r.heads) == 1]

    @property
    def groups(self) -> list[HeadResult]:
        """Results of heads ablated together."""
        return [r for r in self.results if len(r.heads) > 1]

    def ranked(self) -> list[HeadResult]:
        """All results, largest delta first."""
        return sorted(self.results, key=lambda r: (-r.delta, r.heads))

    def _entry(self, result: HeadResult) -> dict[str, Any]:
        entry = result.to_dict(self.layer_names)
        if self.terms is not None and result.heads[0] in self.terms:
            entry["first_order"], entry["second_order"] = self.terms[result.heads[0]]
        return entry

    def csv_rows(self) -> list[dict[str, Any]]:
        """One row per ablation, for CSV: name (`L18H6`; heads ablated together `L5H1+L18H6`), layer and head
        (integers: only where every ablation is one head, so that pandas reads them as integers), loss, delta, the
        parts (same keys in every row), and in estimate mode `value`: exact or estimated."""
        rows = []
        singles = all(len(r.heads) == 1 for r in self.results)
        for r in self.ranked():
            row: dict[str, Any] = {"name": column_name(r.heads, self.layer_names),
                                   **({"layer": r.layer, "head": r.head} if singles else {}),
                                   "loss": r.loss, "delta": r.delta}
            for name in self.baseline_parts:
                row[f"{name}_loss"] = r.parts.get(name, "")
                row[f"{name}_delta"] = r.part_deltas.get(name, "")
            if self.mode == "estimate":  # which numbers are estimates, which were ablated for real
                row["value"] = "exact" if r.exact else "estimated"
            for name in (self.task or {}):
                row[f"task_{name}"] = r.task.get(name, "")
            for name in EFFECT_COLUMNS if any(result.effects for result in self.results) else ():
                row[name] = r.effects.get(name, "")
            rows.append(row)
        return rows

    def to_frame(self) -> Any:
        """A pandas DataFrame, one row per ablation, largest delta first: layer and head (None for a group), name
        (`L5H1`, `L5H1+L18H6`), then the CSV's columns (loss, delta, the parts' losses and deltas; in estimate mode
        `value`: exact or estimated); the ablate schema's columns. Needs pandas."""
        rows = []
        for result, row in zip(self.ranked(), self.csv_rows()):
            single = len(result.heads) == 1
            rows.append({"layer": result.layer if single else None, "head": result.head if single else None,
                         "name": row["name"], **{key: None if value == "" else value for key, value in row.items()
                                                 if key not in ("name", "layer", "head")}})
        return frame(rows)

    def __repr__(self) -> str:
        """A short summary (the dataclass' own repr would print every result)."""
        top = ", ".join(f"{label(r.heads, self.layer_names)} {r.delta:+.4f}" for r in self.ranked()[:3])
        groups = f" and {len(self.groups)} group(s)" if self.groups else ""
        return (f"AblationResult({self.model!r}: {self.method} ablation, {self.mode}, {len(self.heads)} heads{groups} "
                f"of {self.n_layers}x{self.n_heads}, {self.metric} baseline {self.baseline_loss:.4f}; largest delta: "
                f"{top or 'none'})")

    def _repr_html_(self) -> str:
        from probe.reports.html import ablation_page  # lazy, one way: reports renders the plain payload

        return ablation_page(self.to_dict(), embed_plotly=False)  # a notebook output: a fragment

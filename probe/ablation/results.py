"""Results of a sweep: one HeadResult per ablation, gathered in an AblationResult with its baseline and provenance."""

from __future__ import annotations

from dataclasses import field
from typing import Any

from torch import Tensor

from probe.ablation.heads import Ablation, Head, column_name, label
from probe.ablation.metrics import METRICS, losses
from probe.errors import ProbeError
from probe.frames import frame
from probe.schemas.base import Field
from probe.schemas.common import DTYPE, HEAD, LAYER, LAYER_NAMES, MODEL, N_HEADS, N_LAYERS
from probe.schemas.declare import Payload, payload, published, record_fields, schema_field


EFFECT_COLUMNS = ("mean_delta", "max_sequence_delta", "p99_token_delta", "max_token_delta", "specificity")
"""The scalar per-token effects, one CSV column each (the top tokens stay in the JSON)."""


PART_RE = r"^(?!(loss|delta|baseline_loss|first_order|second_order)$).+_(loss|delta)$"
ABLATION_PATTERNS = {PART_RE: Field("number", "a part's loss (PART_loss) or its change (PART_delta): e.g. "
                                              "second_repeat_loss on a repeated set"),
                     r"^task_": Field("number", "task sets: the margin or accuracy with the head ablated")}
"""The fields of an ablation's entry named by a pattern: its parts' and its task's."""


class HeadResult(Payload):
    """The metric with one head (or `heads` together) ablated; `to_dict()` is its entry in the payload."""

    heads: Ablation
    loss: float = schema_field("the metric with the head (or heads) ablated")
    delta: float = schema_field("loss minus the baseline: > 0, the head helps")
    parts: dict[str, float] = field(default_factory=dict)  # e.g. first_repeat / second_repeat losses
    part_deltas: dict[str, float] = field(default_factory=dict)

    @payload("each part's loss and its change", spread=True, patterns={PART_RE: ABLATION_PATTERNS[PART_RE]})
    def part_values(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for name, value in self.parts.items():
            out[f"{name}_loss"] = value
            out[f"{name}_delta"] = self.part_deltas.get(name)
        return out

    exact: bool | None = schema_field(  # estimate mode: True for the heads that were ablated exactly
        "estimate mode: true where the head was ablated for real", required=False, omit="none", default=None)

    @payload("task sets: the margin and accuracy with the head ablated", spread=True,
             patterns={r"^task_": ABLATION_PATTERNS[r"^task_"]})
    def task_values(self) -> dict[str, float]:
        return {f"task_{name}": value for name, value in self.task.items()}

    effects: dict[str, Any] = schema_field(  # per-token and per-sequence effects (sweep._Baseline)
        "per-token and per-sequence effects: mean, max per sequence, p99 and max per token, specificity, the top "
        "tokens in context", required=False, default_factory=dict)
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

    def entry(self, layer_names: list[str] | None = None) -> HeadEntry | GroupEntry:
        """Its entry in the payload: a head's, or a group's (labelled by `layer_names` on an encoder-decoder)."""
        return HeadEntry.of(self) if len(self.heads) == 1 else GroupEntry.of(self, layer_names)

    def to_dict(self, layer_names: list[str] | None = None) -> dict[str, Any]:
        """Its entry (`entry()`), as the payload and the sweep's stream hold it."""
        return self.entry(layer_names).to_dict()

    @staticmethod
    def from_dict(entry: Any) -> HeadResult:
        """The result `to_dict` wrote; a malformed entry refused saying what is wrong (values are never converted)."""
        if not isinstance(entry, dict):
            raise ProbeError(f"an ablation entry is a JSON object, not {type(entry).__name__}")
        try:
            pairs = [(entry["layer"], entry["head"])] if "layer" in entry else list(entry["heads"])
            heads = tuple((_index(a), _index(b)) for a, b in pairs)
            loss, delta = _number(entry["loss"]), _number(entry["delta"])
            # a part or task value that was not finite was written as null: it is read back as None
            parts = {key[:-5]: _optional(value) for key, value in entry.items()
                     if key.endswith("_loss") and key != "loss"}
            deltas = {key[:-6]: _optional(value) for key, value in entry.items()
                      if key.endswith("_delta") and key != "delta"}
            task = {key[5:]: _optional(value) for key, value in entry.items() if key.startswith("task_")}
        except KeyError as error:
            raise ProbeError(f"the ablation entry has no {error.args[0]!r}") from None
        except (TypeError, ValueError) as error:
            raise ProbeError(f"the ablation entry has a malformed value ({error})") from None
        if not heads:
            raise ProbeError("the ablation entry names no head")
        exact, effects = entry.get("exact"), entry.get("effects") or {}
        if exact not in (None, True, False) or not isinstance(effects, dict):
            raise ProbeError("the ablation entry has a malformed value (exact or effects)")
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
    return None if value is None else _number(value)


FIRST_ORDER = Field("number", "estimate mode: the first-order term", required=False)
SECOND_ORDER = Field("number", "estimate mode: the second-order term", required=False)


class HeadEntry(Payload):
    """A head's entry of the payload: its layer and head, what its ablation measured, the estimate's terms."""

    layer: int = schema_field(LAYER)
    head: int = schema_field(HEAD)
    result: HeadResult = schema_field("what its ablation measured", spread=True)
    first_order: float | None = schema_field(FIRST_ORDER, default=None)
    second_order: float | None = schema_field(SECOND_ORDER, default=None)

    @staticmethod
    def of(result: HeadResult, terms: tuple[float, float] | None = None) -> HeadEntry:
        """The entry of a single head's result, with the estimate's first- and second-order `terms` where given."""
        first, second = terms or (None, None)
        return HeadEntry(result.layer, result.head, result, first, second)


class GroupEntry(Payload):
    """The entry of heads ablated together: their heads and label, then what the ablation measured."""

    heads: list[list[int]] = schema_field("its heads as [layer, head]")
    label: str = schema_field("its name, e.g. 5.1+18.6")
    result: HeadResult = schema_field("what its ablation measured", spread=True)
    first_order: float | None = schema_field(FIRST_ORDER, default=None)  # never given: a group has no terms
    second_order: float | None = schema_field(SECOND_ORDER, default=None)

    @staticmethod
    def of(result: HeadResult, layer_names: list[str] | None = None) -> GroupEntry:
        return GroupEntry([list(head) for head in result.heads], label(result.heads, layer_names), result)


MEASURED = record_fields(HeadResult)
"""What an ablation's entry holds besides its heads (`HeadResult`'s declared fields)."""


@published("ablate", 1, "The metric with each head (and each group of heads) ablated, against the baseline (probe "
           "ablate --json).", rows="one per ablation (a head, or a group: layer and head null), largest delta first",
        columns={"layer": Field(("integer", "null"), "the head's layer (null for a group)"),
                 "head": Field(("integer", "null"), "the head (null for a group)"),
                 "name": Field("string", "L18H6, or L5H1+L18H6 for a group"),
                 "loss": MEASURED["loss"], "delta": MEASURED["delta"],
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

    @payload("one entry per head ablated alone", key="heads", items="one head")
    def head_entries(self) -> list[HeadEntry]:
        """Each single head's entry, with the estimate's terms where it has them."""
        terms = self.terms or {}
        return [HeadEntry.of(r, terms.get(r.heads[0])) for r in self.heads]

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

    @payload("heads ablated together", key="groups", required=False, items="one group")
    def group_entries(self) -> list[GroupEntry]:
        return [GroupEntry.of(r, self.layer_names) for r in self.groups]

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

    def csv_rows(self) -> list[dict[str, Any]]:
        """One row per ablation, for CSV: name, layer and head (where all are single heads), loss, delta, parts."""
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
        """A pandas DataFrame, one row per ablation, largest delta first: the ablate schema's columns. Needs pandas."""
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

"""Results of a sweep: one HeadResult per ablation, gathered in an AblationResult with its baseline and provenance."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from probe.ablation.heads import Ablation, Head, label
from probe.ablation.metrics import METRICS, losses
from probe.errors import ProbeError


@dataclass
class HeadResult:
    """The metric with one head ablated (or several together: `heads`)."""

    heads: Ablation
    loss: float
    delta: float
    parts: dict[str, float] = field(default_factory=dict)  # e.g. first_repeat / second_repeat losses
    part_deltas: dict[str, float] = field(default_factory=dict)
    exact: bool | None = None  # estimate mode: True for the heads that were ablated exactly

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

    def to_dict(self) -> dict[str, Any]:
        entry: dict[str, Any] = {}
        if len(self.heads) == 1:
            entry.update(layer=self.layer, head=self.head)
        else:
            entry.update(heads=[list(head) for head in self.heads], label=label(self.heads))
        entry.update(loss=self.loss, delta=self.delta)
        for name, value in self.parts.items():
            entry[f"{name}_loss"] = value
            entry[f"{name}_delta"] = self.part_deltas.get(name)
        if self.exact is not None:
            entry["exact"] = self.exact
        return entry

    @staticmethod
    def from_dict(entry: Any) -> HeadResult:
        """The result `to_dict` wrote; ProbeError saying what is missing or wrong in a malformed entry."""
        if not isinstance(entry, dict):
            raise ProbeError(f"an ablation entry is a JSON object, not {type(entry).__name__}")
        try:
            heads = ((int(entry["layer"]), int(entry["head"])),) if "layer" in entry else tuple(
                (int(a), int(b)) for a, b in entry["heads"])
            loss, delta = float(entry["loss"]), float(entry["delta"])
        except KeyError as error:
            raise ProbeError(f"the ablation entry has no {error.args[0]!r}") from None
        except (TypeError, ValueError) as error:
            raise ProbeError(f"the ablation entry has a malformed value ({error})") from None
        parts = {key[:-5]: value for key, value in entry.items() if key.endswith("_loss") and key != "loss"}
        deltas = {key[:-6]: value for key, value in entry.items() if key.endswith("_delta") and key != "delta"}
        return HeadResult(heads, loss, delta, parts, deltas, entry.get("exact"))


@dataclass
class AblationResult:
    """Baseline and ablated metric of every ablation of a sweep, plus how it was computed."""

    model: str
    method: str  # "zero" or "mean"
    data: str  # "natural", "repeated" or the text file
    metric: str  # a key of METRICS
    baseline_loss: float
    results: list[HeadResult]
    n_layers: int
    n_heads: int
    mode: str = "exact"  # "exact", "naive" or "estimate"
    path: str = ""  # how the numbers were computed
    baseline_parts: dict[str, float] = field(default_factory=dict)
    probe_set: dict[str, Any] = field(default_factory=dict)
    mean: str | None = None  # mean ablation: what the means were taken over
    seconds: float | None = None
    forwards: float | None = None  # cost in forward-pass equivalents (estimate mode)
    terms: dict[Head, tuple[float, float]] | None = None  # estimate mode: (first-order, second-order) per head

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

    def to_dict(self) -> dict[str, Any]:
        metric = METRICS.get(self.metric)
        data: dict[str, Any] = {
            "model": self.model, "method": self.method, "data": self.data, "metric": self.metric,
            "metric_description": metric.description if metric is not None else self.metric,
            "baseline_loss": self.baseline_loss, "heads": [self._entry(r) for r in self.heads],
            "n_layers": self.n_layers, "n_heads": self.n_heads, "mode": self.mode, "path": self.path,
        }
        for name, value in self.baseline_parts.items():
            data[f"baseline_{name}_loss"] = value
        if self.groups:
            data["groups"] = [r.to_dict() for r in self.groups]
        if self.mean is not None:
            data["mean"] = self.mean
        if self.probe_set:
            data["probe_set"] = self.probe_set
        if self.seconds is not None:
            data["seconds"] = round(self.seconds, 3)
        if self.forwards is not None:
            data["forward_equivalents"] = round(self.forwards, 3)
        return data

    def _entry(self, result: HeadResult) -> dict[str, Any]:
        entry = result.to_dict()
        if self.terms is not None and result.heads[0] in self.terms:
            entry["first_order"], entry["second_order"] = self.terms[result.heads[0]]
        return entry

    def csv_rows(self) -> list[dict[str, Any]]:
        """One row per ablation, for CSV: label, layer, head, loss, delta, and the parts (same keys in every row)."""
        rows = []
        for r in self.ranked():
            row: dict[str, Any] = {"heads": label(r.heads), "layer": r.layer if len(r.heads) == 1 else "",
                                   "head": r.head if len(r.heads) == 1 else "", "loss": r.loss, "delta": r.delta}
            for name in self.baseline_parts:
                row[f"{name}_loss"] = r.parts.get(name, "")
                row[f"{name}_delta"] = r.part_deltas.get(name, "")
            rows.append(row)
        return rows

    def _repr_html_(self) -> str:
        from probe.reports.html import ablation_page  # lazy, one way: reports renders the plain payload

        return ablation_page(self.to_dict())

"""`Atlas`: every head's evidence in one result, its `to_dict()` the payload of `probe atlas --json` and the page."""

from __future__ import annotations

from dataclasses import field
from typing import Any

from probe.frames import frame, head_rows
from probe.headvis.metrics import METRICS as HEADVIS_METRICS
from probe.headvis.result import UNITS as HEADVIS_UNITS
from probe.heads.evidence import CAUSE_DELTA, COMPOSITION_RATIO, PART_DELTA, RULES
from probe.patterns import Patterns
from probe.schemas.base import Field
from probe.schemas.common import (CLASSES, DTYPE, HEAD, HEAD_COLUMNS, LAYER, LAYER_NAMES, MODEL, N_HEADS, N_LAYERS,
                                  NAME_RE, NUMBER, other_than)
from probe.schemas.declare import Payload, payload, published, schema_field

HEADVIS = "headvis_"  # the prefix of a HeadVis metric's name among the atlas' metrics
METRICS = {
    "delta": "mean loss change on natural text when the head is zero-ablated (nats)",
    "specificity": "share of the head's loss increase on its top 1% of tokens",
    "max_token_delta": "largest loss change of one token when the head is ablated",
    "second_repeat_delta": "loss change on the second copy of a repeated sequence (heads of classes that name it)",
    "task_delta": "task margin loss change when the head is ablated (--task)",
    "copying": "copying score: sum(eigenvalues) / sum(|eigenvalues|) of W_E W_OV W_U",
    "dla": "direct logit attribution to the correct next token on natural text, mean over positions",
    "self_repair": "log-likelihood the rest of the model gives back when the head is zero-ablated on natural text: "
                   "total change minus the head's direct effect (--self-repair)",
    "output_norm": "mean norm of what the head writes into the residual stream",
    "nonfirst_attention": "mean over positions of the head's largest attention to a key after the first",
    "k_in": "strongest K-composition into this head from an earlier head",
    "out": "strongest composition of this head into a later head (any kind)",
    **{HEADVIS + name: f"Neuronpedia HeadVis's {name} on natural text ({HEADVIS_UNITS[name]})"
       for name in HEADVIS_METRICS},
}
"""Per-head numbers the head finder can plot (`<class>` scores come on top), with what each means."""


class Stage(Payload):
    """One stage of the build: how long it took and what to know of it (skipped, estimated, ...)."""

    name: str = schema_field("the stage")
    seconds: float = schema_field("its wall time", dump=lambda seconds: round(seconds, 2))
    note: str = schema_field("skipped, estimated, ... ('' where nothing to say)", default="")


@published("atlas", 1, "Every head of a model: its classes with their evidence, metrics, examples, writes, partners "
           "and effects (probe atlas --json).", rows="one per head, layer by layer",
           columns=(ATLAS_COLUMNS := {**HEAD_COLUMNS, "status": Field("string", "the strongest support of its labels"),
                                      "pattern": Field(("string", "null"), "the probe set of its pattern"),
                                      "classes": Field("string", "its classes, comma-separated")}),
           column_patterns={other_than(ATLAS_COLUMNS): Field("number", "a metric of the head (a column per metric: "
                                                                       "the atlas' metrics)")})
class Atlas(Payload):
    """Every head of a model: classes with their evidence, examples, writes, partners, effects; `patterns` page-only."""

    model: str = schema_field(MODEL)
    n_layers: int = schema_field(N_LAYERS)
    n_heads: int = schema_field(N_HEADS)

    @payload(DTYPE.description)
    def dtype(self) -> str:
        return str(self.settings.get("dtype", "float32"))

    layer_names: list[str] | None = schema_field(LAYER_NAMES, default=None, kw_only=True)
    heads: list[dict[str, Any]]
    classes: dict[str, dict[str, Any]]
    settings: dict[str, Any] = schema_field("the options of the build and the baselines it measured")
    stages: list[Stage] = schema_field("each stage run", items="a stage", default_factory=list)

    @payload(CLASSES.description, key="classes", patterns=CLASSES.patterns)
    def class_entries(self) -> dict[str, dict[str, Any]]:
        return self.classes

    @payload("the metrics the heads have, with what each means",
             patterns={NAME_RE: Field("string", "what the metric means")})
    def metrics(self) -> dict[str, str]:
        return {name: text for name, text in METRICS.items()
                if any(entry["metrics"].get(name) is not None for entry in self.heads)}

    @payload("the evidence rules and their thresholds")
    def evidence(self) -> dict[str, Any]:
        return {"cause_delta": CAUSE_DELTA, "part_delta": PART_DELTA, "composition_ratio": COMPOSITION_RATIO,
                "rules": {name: rule.describe() for name, rule in RULES.items()}}

    @payload("counts of labels by support, where pattern and cause disagree")
    def summary(self) -> dict[str, Any]:
        """Counts of labels by how well they are supported, and where pattern and cause disagree."""
        labels = [(entry, label) for entry in self.heads for label in entry["classes"]]
        by_class: dict[str, dict[str, int]] = {}
        for _, label in labels:
            counts = by_class.setdefault(label["class"], {})
            counts[label["evidence"]["status"]] = counts.get(label["evidence"]["status"], 0) + 1
        needed = [e for e in self.heads if (e["metrics"].get("delta") or 0) > CAUSE_DELTA]
        return {"labels": len(labels), "by_class": by_class,
                "pattern_only": [_name(e) + " " + lab["class"] for e, lab in labels
                                 if lab["evidence"]["status"] == "pattern_only"],
                "needed_without_label": [_name(e) for e in sorted(needed, key=lambda e: -e["metrics"]["delta"])
                                         if not e["classes"]],
                "needed": len(needed)}

    @payload("every head, layer by layer", key="heads", type="array", items=Field(
        "object", "one head's dashboard", fields={
            "layer": LAYER, "head": HEAD,
            "classes": Field("array", "its classes, each with its evidence"),
            "status": Field("string", "the strongest support any of its labels has"),
            "pattern": Field(("string", "null"), "the probe set its pattern is shown on"),
            "metrics": Field("object", "its numbers by metric", patterns={NAME_RE: NUMBER}),
            "examples": Field("array", "where it attends most, in context"),
            "writes": Field("array", "what it writes through the unembedding"),
            "partners": Field("object", "its composition feeders and readers"),
            "effects": Field("object", "its causal effects"),
            "task": Field(("object", "null"), "a task set's effects"),
            "self_repair": Field(("object", "null"), "its self-repair, where measured")}))
    def dashboards(self) -> list[dict[str, Any]]:
        return self.heads

    patterns: dict[str, Patterns] = field(default_factory=dict)

    def head(self, layer: int, head: int) -> dict[str, Any]:
        return self.heads[layer * self.n_heads + head]

    def to_frame(self) -> Any:
        """A pandas DataFrame, one row per head: the atlas schema's columns. Needs pandas."""
        rows = head_rows(self.heads, ("status", "pattern"), self.layer_names, classes="class")
        for row, entry in zip(rows, self.heads):
            row.update(entry["metrics"])
        return frame(rows)

    def __repr__(self) -> str:
        summary = self.summary
        confirmed = sum(counts.get("confirmed", 0) for counts in summary["by_class"].values())
        return (f"Atlas({self.model!r}: {self.n_layers}x{self.n_heads} heads, {summary['labels']} labels, "
                f"{confirmed} confirmed, {len(summary['pattern_only'])} pattern only)")

    def _repr_html_(self) -> str:
        from probe.reports.atlas import atlas_page  # reports render; the library never needs them otherwise

        return atlas_page(self.to_dict(), {name: p.page_payload() for name, p in self.patterns.items()},
                          embed_plotly=False)


def _name(entry: dict[str, Any]) -> str:
    return f"{entry['layer']}.{entry['head']}"

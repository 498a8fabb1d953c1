"""A training run's trajectories per checkpoint, and the phase changes in them (Olsson et al. 2022, section 3): per
class the interval where the best head's score rises most, and whether the ICL score changes most there too."""

from __future__ import annotations

import math
from typing import Any, TypeGuard

from probe.frames import frame, head_name
from probe.schemas.base import Field
from probe.schemas.common import CLASSES, DTYPE, HEAD_COLUMNS, MODEL, N_HEADS, N_LAYERS, THRESHOLDS, other_than
from probe.schemas.declare import Payload, payload, published, schema_field

MIN_RISE = 0.1  # the smallest rise of the best head's score that counts as a phase change (scores are 0 to 1)


class CheckpointResult(Payload):
    """One checkpoint's numbers; `heads`: classify's per-head entries, with "delta" where heads were ablated."""

    name: str = schema_field("its file, folder or revision")
    step: int = schema_field("its step")
    loss: float | None = schema_field("the probe text's loss", type="number")
    icl_score: float | None = schema_field("the in-context learning score (null where the context is too short)",
                                           type="number")
    heads: list[dict[str, Any]] = schema_field("every head's scores (and delta)")
    notes: list[str] = schema_field("what to know of it", required=False, default_factory=list)

    @staticmethod
    def from_dict(entry: dict[str, Any]) -> CheckpointResult:
        return CheckpointResult(str(entry["name"]), int(entry["step"]), entry.get("loss"), entry.get("icl_score"),
                                list(entry["heads"]), list(entry.get("notes", [])))


def _finite(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and math.isfinite(value)


def best_scores(checkpoints: list[CheckpointResult], name: str) -> list[float | None]:
    """The best head's score of class `name` at each checkpoint (None where no head has one)."""
    finite = [[v for v in (entry["scores"].get(name) for entry in c.heads) if _finite(v)] for c in checkpoints]
    return [max(values) if values else None for values in finite]


def _largest_step(values: list[float | None], either_way: bool = False) -> tuple[int, float] | None:
    """(i, change) of the interval i -> i + 1 whose rise (or change, `either_way`) is largest; the first of equals."""
    changes = [(i, b - a) for i, (a, b) in enumerate(zip(values, values[1:])) if _finite(a) and _finite(b)]
    if not changes:
        return None
    return max(changes, key=lambda item: abs(item[1]) if either_way else item[1])


def icl_change(checkpoints: list[CheckpointResult]) -> dict[str, Any] | None:
    """The interval where the in-context learning score changes most (either way), and by how much."""
    found = _largest_step([c.icl_score for c in checkpoints], either_way=True)
    if found is None or found[1] == 0:
        return None
    index, change = found
    return {"from_step": checkpoints[index].step, "to_step": checkpoints[index + 1].step, "change": change}


def _crossing(before: CheckpointResult, after: CheckpointResult, name: str, threshold: float) -> list[str]:
    """Heads at or under the threshold before and over it after, highest score after first."""
    crossed = []
    for old, new in zip(before.heads, after.heads):
        a, b = old["scores"].get(name), new["scores"].get(name)
        if _finite(a) and _finite(b) and a <= threshold < b:
            crossed.append((-b, f"{new['layer']}.{new['head']}"))
    return [label for _, label in sorted(crossed)]


def phase_changes(checkpoints: list[CheckpointResult], thresholds: dict[str, float], *,
                  min_rise: float = MIN_RISE) -> list[dict[str, Any]]:
    """For each class, the interval where the best head's score rises most (at least `min_rise`), and the ICL change."""
    icl = icl_change(checkpoints)
    found = []
    for name, threshold in thresholds.items():
        best = best_scores(checkpoints, name)
        step = _largest_step(best)
        if step is None or step[1] < min_rise:
            continue
        index, rise = step
        known = [b for b in best if _finite(b)]
        before, after = checkpoints[index], checkpoints[index + 1]
        icl_before, icl_after = before.icl_score, after.icl_score
        found.append({"class": name, "from_step": before.step, "to_step": after.step,
                      "heads": _crossing(before, after, name, threshold), "rise": rise,
                      "share_of_range": rise / (max(known) - min(known)),
                      "best_before": best[index], "best_after": best[index + 1],
                      "icl_change": icl_after - icl_before if _finite(icl_before) and _finite(icl_after) else None,
                      "coincides_with_icl": icl is not None and (icl["from_step"], icl["to_step"]) == (
                          before.step, after.step)})
    return found


@published("track", 1, "Heads across training: every checkpoint's head scores, loss and ICL score, and the phase "
           "changes (probe track --json).", rows="one per checkpoint and head",
           columns=(TRACK_COLUMNS := {
               "checkpoint": Field("string", "the checkpoint's name"), "step": Field("integer", "its step"),
               "loss": Field("number", "its loss"), "icl_score": Field("number", "its ICL score"), **HEAD_COLUMNS,
               "delta": Field("number", "--heads: the head's ablation delta", required=False)}),
           column_patterns={other_than(TRACK_COLUMNS): Field("number", "the head's score of this class at this "
                                                                       "checkpoint")})
class TrackResult(Payload):
    """Every checkpoint's numbers in step order, and what the run shows."""

    model: str = schema_field(MODEL)
    kind: str = schema_field(  # folders, revisions, state_dicts
        "how the checkpoints were given: folders, revisions, state_dicts")
    dtype: str = schema_field(DTYPE, default="float32", kw_only=True)  # what the models ran in (docs/precision.md)

    @payload(N_LAYERS.description)
    def n_layers(self) -> int:
        first = self.checkpoints[0].heads if self.checkpoints else []
        return 1 + max((e["layer"] for e in first), default=-1)

    @payload(N_HEADS.description)
    def n_heads(self) -> int:
        first = self.checkpoints[0].heads if self.checkpoints else []
        return 1 + max((e["head"] for e in first), default=-1)

    checkpoints: list[CheckpointResult]
    thresholds: dict[str, float] = schema_field(THRESHOLDS)
    classes: dict[str, dict[str, Any]] = schema_field(CLASSES)
    options: dict[str, Any] = schema_field("the options of the run, and the run's checkpoints")
    min_rise: float = schema_field("the smallest rise that counts as a phase change", default=MIN_RISE)
    heads_ablated: list[str] = schema_field("--heads: the heads whose ablation delta is tracked", required=False,
                                            default_factory=list)

    @payload("each checkpoint in step order", key="checkpoints", items="a checkpoint")
    def checkpoint_entries(self) -> list[CheckpointResult]:
        return self.checkpoints

    @payload("per class, the interval of the best head's largest rise", key="phase_changes")
    def phase_change_list(self) -> list[dict[str, Any]]:
        return self.phase_changes

    @payload("where the ICL score changes most")
    def icl_change(self) -> dict[str, Any] | None:
        return icl_change(self.checkpoints)

    @property
    def phase_changes(self) -> list[dict[str, Any]]:
        return phase_changes(self.checkpoints, self.thresholds, min_rise=self.min_rise)

    def rows(self) -> list[dict[str, Any]]:
        """One row per checkpoint x head: the trajectories as a table (CSV)."""
        return [{"checkpoint": c.name, "step": c.step, "loss": c.loss, "icl_score": c.icl_score,
                 "layer": e["layer"], "head": e["head"], **e["scores"], "name": head_name(e["layer"], e["head"]),
                 **({"delta": e.get("delta")} if self.heads_ablated else {})}
                for c in self.checkpoints for e in c.heads]

    def to_frame(self) -> Any:
        """A pandas DataFrame, one row per checkpoint and head: the track schema's columns. Needs pandas."""
        return frame(self.rows())

    def __repr__(self) -> str:
        changes = ", ".join(f"{p['class']} {p['from_step']}->{p['to_step']}" for p in self.phase_changes) or "none"
        return f"TrackResult({self.model!r}: {len(self.checkpoints)} checkpoints; phase changes: {changes})"

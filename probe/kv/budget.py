"""How many KV heads stream: a calibrated budget, kvpress's (`kvpress_budget`) or a fixed one, and its labels."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from probe.frames import frame
from probe.headmaps.kvpress import kvpress_removable, kvpress_streamed
from probe.errors import ProbeError
from probe.models import LoadedModel
from probe.progress import ProgressArg, callback, reports
from probe.provenance import model_dtype
from probe.schemas.common import DTYPE
from probe.schemas.declare import Payload, schema_field
from probe.kv.points import CurveInputs, measured_point


DEFAULT_FULL_FRACTION = 0.25  # the fixed budget's default, where a fixed budget is asked for
DEFAULT_MAX_LOSS_INCREASE = 0.03


def full_heads(order: list[tuple[int, int]], retrieval: Tensor, streaming: Tensor, *, full_fraction: float | None,
               retrieval_threshold: float | None, streaming_threshold: float | None) -> set[tuple[int, int]]:
    """The KV heads labelled full: the last `full_fraction` of the order, or by thresholds where given."""
    if retrieval_threshold is not None or streaming_threshold is not None:
        return {h for h in order if (retrieval_threshold is not None and float(retrieval[h]) > retrieval_threshold)
                or (streaming_threshold is not None and float(streaming[h]) < streaming_threshold)}
    fraction = DEFAULT_FULL_FRACTION if full_fraction is None else full_fraction
    if not 0.0 <= fraction <= 1.0:
        raise ProbeError(f"full_fraction is a fraction of the KV heads, in [0, 1]; got {fraction}",
                         parameter="full_fraction")
    n_full = round(fraction * len(order))
    return set(order[len(order) - n_full:]) if n_full else set()


class Budget(Payload):
    """How many KV heads stream, and why: the rule, and every point the search measured."""

    rule: str = schema_field("how the budget was chosen")
    streamed: int = schema_field("KV heads streamed")
    total: int = schema_field("KV heads")
    points: list[dict[str, Any]] = schema_field("every point measured", type="array", default_factory=list)
    measured_on: dict[str, Any] = schema_field("the held-out inputs", default_factory=dict)
    dtype: str = schema_field(DTYPE, default="float32")  # docs/precision.md: how far a half-precision run lies
    kvpress: dict[str, Any] | None = schema_field(  # a kvpress budget: the ratio asked, the head_compression_ratio
        "kvpress's ratio and head_compression_ratio", required=False, omit="none", default=None)

    def to_frame(self) -> Any:
        """A pandas DataFrame, one row per point the search measured: the kv-budget schema's columns. Needs pandas."""
        return frame([{key: point[key] for key in ("k", "loss_change", "needle_accuracy", "accepted")}
                      for point in self.points])


def accepts(point: dict[str, Any], baseline_accuracy: float, max_loss_increase: float) -> bool:
    return point["needle_accuracy"] >= baseline_accuracy and point["loss_change"] <= max_loss_increase


@reports("calibrating the budget")
def calibrate_budget(loaded: LoadedModel, order: list[tuple[int, int]], inputs: CurveInputs, *,
                     max_loss_increase: float = DEFAULT_MAX_LOSS_INCREASE,
                     progress: ProgressArg = None) -> Budget:
    """The largest k (the first k KV heads of `order` streamed) that keeps the unablated needle accuracy and the
    loss change within `max_loss_increase`, by bisection; every point measured is in the result."""
    cache: dict[frozenset[tuple[int, int]], tuple[float, float]] = {}
    report = callback(progress)
    most = budget_points(len(order)) + 1  # the unablated model's point, then at most one per halving
    base_loss, base_accuracy = measured_point(loaded, inputs, [], cache)
    if report is not None:
        report(1, most)
    points: list[dict[str, Any]] = []

    def measure(k: int) -> bool:
        loss, accuracy = measured_point(loaded, inputs, order[:k], cache)
        point = {"k": k, "loss_change": round(loss - base_loss, 6), "needle_accuracy": round(accuracy, 6)}
        point["accepted"] = accepts(point, base_accuracy, max_loss_increase)
        points.append(point)
        if report is not None:
            report(1 + len(points), most)
        return bool(point["accepted"])

    low, high = 0, len(order) + 1  # k = low is accepted (nothing streamed), k = high is not (past the end)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if measure(middle) else (low, middle)
    rule = (f"calibrated: the largest k whose measured point keeps needle accuracy >= {base_accuracy:.2f} (the "
            f"unablated model's) and the loss change <= +{max_loss_increase:g}, by bisection over the order")
    return Budget(rule, low, len(order), sorted(points, key=lambda point: point["k"]),
                  _measured_on(inputs, base_loss, base_accuracy), model_dtype(loaded))


def _measured_on(inputs: CurveInputs, base_loss: float, base_accuracy: float) -> dict[str, Any]:
    """What a budget's points were measured on, and the unablated model's loss and needle accuracy there."""
    return {"baseline_loss": round(base_loss, 6), "baseline_needle_accuracy": round(base_accuracy, 6),
            "natural_texts": int(inputs.texts.shape[0]), "natural_length": int(inputs.texts.shape[1]),
            "needle_prompts": int(inputs.needles.input_ids.shape[0])}


def kvpress_budget(loaded: LoadedModel, order: list[tuple[int, int]], inputs: CurveInputs | None, ratio: float, *,
                   sink: int, recent: int, length: int, max_loss_increase: float = DEFAULT_MAX_LOSS_INCREASE,
                   why: str | None = None) -> Budget:
    """The k KV heads DuoAttentionPress streams to remove `ratio` of the cache, measured on `inputs` (None: `why`)."""
    streamed, head_ratio = kvpress_streamed(ratio, len(order), sink, recent, length)
    removed = head_ratio * kvpress_removable(sink, recent, length)
    rule = (f"kvpress: head_compression_ratio {head_ratio:.6g} streams the {streamed} lowest-scored of {len(order)} "
            f"KV heads, removing {removed:.4f} of a {length}-token KV cache ({ratio:g} asked)")
    budget = Budget(rule + ("" if why is None else f" ({why})"), streamed, len(order), dtype=model_dtype(loaded),
                    kvpress={"compression_ratio": ratio, "head_compression_ratio": head_ratio, "length": length,
                             "removed": round(removed, 6), "sink_size": sink, "recent_size": recent})
    if inputs is not None:
        cache: dict[frozenset[tuple[int, int]], tuple[float, float]] = {}
        base_loss, base_accuracy = measured_point(loaded, inputs, [], cache)
        loss, accuracy = measured_point(loaded, inputs, order[:streamed], cache)
        point = {"k": streamed, "loss_change": round(loss - base_loss, 6), "needle_accuracy": round(accuracy, 6)}
        budget.points = [{**point, "accepted": accepts(point, base_accuracy, max_loss_increase)}]
        budget.measured_on = _measured_on(inputs, base_loss, base_accuracy)
    return budget


def budget_points(n_kv_total: int) -> int:
    """The most points the budget's bisection measures: one per halving of k = 1 .. all."""
    return max(n_kv_total, 1).bit_length()


def fixed_budget(order: list[tuple[int, int]], kv_retrieval: Tensor, kv_streaming: Tensor, full_fraction: float | None,
                  thresholds: tuple[float | None, float | None], dtype: str,
                  why: str | None = None) -> tuple[Budget, set[tuple[int, int]]]:
    """The full KV heads of a fixed budget (a fraction, or thresholds) and its rule (`why`: why not calibrated)."""
    full = full_heads(order, kv_retrieval, kv_streaming, full_fraction=full_fraction,
                      retrieval_threshold=thresholds[0], streaming_threshold=thresholds[1])
    if thresholds != (None, None):
        rule = f"fixed: full where retrieval > {thresholds[0]} or streaming < {thresholds[1]} (thresholds given)"
    else:
        fraction = DEFAULT_FULL_FRACTION if full_fraction is None else full_fraction
        rule = f"fixed: the last {fraction:g} of the order full"
    return Budget(rule + ("" if why is None else f" ({why})"), len(order) - len(full), len(order),
                  dtype=dtype), full

"""Points along the streaming order (text loss and needle accuracy with the first k KV heads windowed, on held-out
inputs): how many KV heads stream (a calibrated budget, kvpress's or a fixed one) and the order's check against random
orders (`stream_curve`)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from probe.ablation.methods import ablated
from probe.ablation.window import WindowAblation
from probe.errors import ProbeError
from probe.frames import frame
from probe.headmaps.kvpress import kvpress_removable, kvpress_streamed
from probe.hooks.run import logits_of, run_model
from probe.inputs import NeedleSet
from probe.kv.order import query_heads
from probe.kv.scoring import needle_accuracy
from probe.models import LoadedModel
from probe.overflow import forwards, require_finite
from probe.progress import ProgressArg, callback, reports
from probe.provenance import model_dtype
from probe.schemas.common import DTYPE
from probe.schemas.declare import Payload, schema_field


def text_loss(loaded: LoadedModel, texts: Tensor) -> float:
    """Mean next-token cross-entropy over the sequences `texts` (n, length), one forward each."""
    total, count = 0.0, 0
    for row in texts:
        ids = row[None]
        with torch.no_grad():
            logits = logits_of(run_model(loaded.model, ids, None)).float()  # (1, n, vocab)
        targets = ids[:, 1:].to(logits.device)
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], targets[0], reduction="sum")
        total, count = total + float(loss), count + targets.numel()
    return total / max(count, 1)


@dataclass
class CurveInputs:
    texts: Tensor  # (n, length) natural text
    needles: NeedleSet  # prompts other than the scored ones
    group: int
    method: WindowAblation


def measured_point(loaded: LoadedModel, inputs: CurveInputs, streamed: list[tuple[int, int]],
           cache: dict[frozenset[tuple[int, int]], tuple[float, float]]) -> tuple[float, float]:
    """(natural-text loss, needle accuracy) with the KV heads `streamed` windowed; cached by the set of heads."""
    key = frozenset(streamed)
    if key not in cache:
        heads = tuple(query_heads(sorted(key), inputs.group))
        with ablated(loaded.model, [heads] if heads else [], inputs.method):
            loss = text_loss(loaded, inputs.texts)
            run = needle_accuracy(loaded, inputs.needles)
        cache[key] = (loss, sum(run.exact) / max(len(run.exact), 1))
    return cache[key]


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


def curve_steps(n_kv_total: int, steps: int) -> list[int]:
    """k = 0 .. n_kv_total in about `steps` even steps."""
    if steps < 1:
        raise ProbeError(f"steps must be at least 1, got {steps}", parameter="steps")
    return sorted({round(i * n_kv_total / steps) for i in range(steps + 1)})


@reports("checking the order")
def stream_curve(loaded: LoadedModel, order: list[tuple[int, int]], inputs: CurveInputs, ks: list[int],
                 seeds: list[int], *, progress: ProgressArg = None,
                 stop_below: float | None = DEFAULT_MAX_LOSS_INCREASE) -> dict[str, Any]:
    """Loss change and needle accuracy with the first k KV heads of `order` windowed, and of random orders (one
    clearly below probe's stops with `stop_below`, its later points None)."""
    cache: dict[frozenset[tuple[int, int]], tuple[float, float]] = {}
    report = callback(progress)
    orders = {"probe": order} | {f"random_{seed}": random.Random(seed).sample(order, len(order)) for seed in seeds}
    base_loss, base_accuracy = measured_point(loaded, inputs, [], cache)
    require_finite(base_loss, "the unablated model's loss on natural text", loaded.model,
                   forwards(loaded.model, inputs.texts, None, 1))
    total, done = len(orders) * len(ks), 0
    curves: dict[str, dict[str, list[float | None]]] = {}
    stopped: dict[str, int] = {}
    for name, ordering in orders.items():
        losses: list[float | None] = []
        accuracies: list[float | None] = []
        for index, k in enumerate(ks):
            if name in stopped and frozenset(ordering[:k]) not in cache:
                losses.append(None)
                accuracies.append(None)
            else:
                loss, accuracy = measured_point(loaded, inputs, ordering[:k], cache)
                losses.append(round(loss - base_loss, 6))
                accuracies.append(round(accuracy, 6))
            done += 1
            if report is not None:
                report(done, total)
            if name != "probe" and name not in stopped and stop_below is not None and _clearly_below(
                    losses[index], accuracies[index], curves["probe"], index, base_accuracy, stop_below):
                stopped[name] = k
        curves[name] = {"loss_change": losses, "needle_accuracy": accuracies}
    return {"k": ks, "baseline_loss": round(base_loss, 6), "baseline_needle_accuracy": round(base_accuracy, 6),
            "orders": curves, "random_seeds": seeds, "natural_texts": int(inputs.texts.shape[0]),
            "natural_length": int(inputs.texts.shape[1]), "needle_prompts": int(inputs.needles.input_ids.shape[0]),
            "stopped": stopped, "stop_rule": None if stop_below is None else (
                f"a random order stops at its first k refused (needle accuracy < {base_accuracy:.2f} or loss change > "
                f"+{stop_below:g}) where probe's order is kept; later points are null unless already measured")}


def _clearly_below(loss: float | None, accuracy: float | None, ours: dict[str, list[float | None]], index: int,
                   baseline_accuracy: float, max_loss_increase: float) -> bool:
    """Whether a random order's point is refused by the budget's rule while probe's point at the same k is kept."""
    if loss is None or accuracy is None:
        return False
    refused = not accepts({"loss_change": loss, "needle_accuracy": accuracy}, baseline_accuracy, max_loss_increase)
    kept = {"loss_change": ours["loss_change"][index], "needle_accuracy": ours["needle_accuracy"][index]}
    return refused and accepts(kept, baseline_accuracy, max_loss_increase)

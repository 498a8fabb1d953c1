"""The streaming order's check: loss change and needle accuracy with the first k KV heads windowed, vs random."""

from __future__ import annotations

import random
from typing import Any

from probe.errors import ProbeError
from probe.overflow import forwards, require_finite
from probe.models import LoadedModel
from probe.progress import ProgressArg, callback, reports
from probe.kv.budget import DEFAULT_MAX_LOSS_INCREASE, accepts
from probe.kv.points import CurveInputs, measured_point


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

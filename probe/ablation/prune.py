"""`prune`: pruning curves. Remove heads step by step and measure the loss with all removed heads ablated together.

Orderings: "michel" (Michel et al. 2019: importance E_x |dL/dxi_h| of a gate on each head's output, normalised per
layer, recomputed after every step), "sweep" (the exact single-head sweep's order) and "random" (a band over seeds).
A unit is a query head, or with `kv_groups` a key/value group. Cost is bounded (at most ceil(1 / step) loss passes
per ordering), so no resume."""

from __future__ import annotations

import math
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial, reduce
from typing import Any

import torch
from torch import Tensor

from probe.frames import frame
from probe.ablation.estimate import keeping_graph, scaled_gradients
from probe.ablation.heads import Head, as_column, label, layer_shape
from probe.ablation.methods import AblationMethod, ablated, build_method
from probe.ablation.metrics import METRICS, Metric, choose_metric, losses
from probe.ablation.runners import Work, check_probe_set, data_name, require_finite_baseline
from probe.ablation.sweep import sweep_runner, sweep_units
from probe.hooks.capture import attention_hooks
from probe.hooks.layers import attention_layers
from probe.hooks.run import logits_of, run_model
from probe.inputs import ProbeSet
from probe.errors import ProbeError
from probe.hooks.stacks import layer_names
from probe.models import LoadedModel
from probe.progress import ProgressArg, callback, reports
from probe.provenance import model_dtype
from probe.schemas.base import Field
from probe.schemas.common import DTYPE, LAYER_NAMES, MODEL, N_HEADS, N_LAYERS, SECONDS
from probe.schemas.declare import Payload, columns, payload, published, schema_field

ORDERINGS = ("michel", "sweep", "random")
Unit = tuple[Head, ...]
"""What one pruning decision removes: one query head, or a key/value group's query heads."""


def prune_units(loaded: LoadedModel, kv_groups: bool = False) -> list[Unit]:
    """Every query head alone, or (`kv_groups`) every key/value group: the query heads sharing its keys and values."""
    units: list[Unit] = []
    for layer in attention_layers(loaded.model):
        size = layer.n_heads // max(layer.n_kv_heads, 1) if kv_groups else 1
        units += [tuple((layer.index, head) for head in range(first, first + size))
                  for first in range(0, layer.n_heads, size)]
    return units


class PruneStep(Payload):
    """One step of a curve: the units pruned so far, all ablated together, and the loss then."""

    step: int = schema_field("the step (0: nothing pruned)", column=True)
    units_removed: int = schema_field("units pruned so far", column=True)
    heads_removed: int = schema_field("query heads pruned so far", column=True)
    share: float = schema_field("the share of units pruned", key="share_pruned", column=True,  # of the units
                                dump=lambda share: round(share, 6))
    loss: float = schema_field("the loss with them all ablated", column=True)
    delta: float = schema_field("loss - baseline", column=True)
    removed: list[str] = schema_field("the units removed at this step", column=Field(
        "string", "the units removed at this step (L5H1 ...), space-separated"))


class PruneCurve(Payload):
    """One ordering's curve (and seed, for a random one)."""

    ordering: str = schema_field("michel, sweep or random")
    seed: int | None = schema_field("a random ordering's seed")
    stopped: str = schema_field("why the curve ends", kw_only=True)
    kept: list[list[int]] = schema_field(  # per layer, 1 for a head kept, at the last step within the allowed increase
        "per layer, 1 for a head kept at the last step within the allowed increase", key="kept_mask")
    steps: list[PruneStep] = schema_field("each step", items=Field("object", "a step"))


@published("prune", 1, "Pruning curves: per ordering, the loss after each step with every pruned head ablated together "
           "(probe prune).", rows="one per curve and step",
           columns=columns({"ordering": Field("string", "the curve's ordering"),
                            "seed": Field(("integer", "null"), "a random ordering's seed")}, PruneStep))
class PruneResult(Payload):
    """Pruning curves: per ordering, the loss after each step with every pruned head ablated together."""

    model: str = schema_field(MODEL)
    metric: str = schema_field("the metric")
    method: str = schema_field("the ablation")
    data: str = schema_field("the data the order was chosen on")
    units: str = schema_field("heads or kv_groups: what one pruning decision removes")  # "heads" or "kv_groups"
    n_units: int = schema_field("units there are")
    n_layers: int = schema_field(N_LAYERS)
    n_heads: int = schema_field(N_HEADS)
    dtype: str = schema_field(DTYPE, default="float32", kw_only=True)  # docs/precision.md: how far half precision lies

    @payload("the data the losses were measured on", key="measured_on")
    def measured(self) -> str:
        return self.measured_on or self.data

    baseline_loss: float = schema_field("the loss with nothing pruned")
    step: float = schema_field("the share of units pruned per step")
    limit: float | None = schema_field(  # from max_increase
        "the largest loss allowed (null: prune to 100%)", key="max_loss")
    measured_on: str | None = None  # where the losses were measured, when not on the data the order was chosen on
    seconds: float = schema_field(SECONDS, default=0.0, kw_only=True, dump=lambda seconds: round(seconds, 3))
    costs: dict[str, float] = schema_field("what the run cost: seconds, passes, forward-equivalents",
                                           default_factory=dict, kw_only=True)

    @payload("what pruning a query head alone leaves running, or null")
    def note(self) -> str | None:
        return None if self.units == "kv_groups" else ("query heads pruned alone: the key/value projections of a "
                                                       "grouped-query layer still run in full")

    curves: list[PruneCurve] = schema_field("one curve per ordering (and seed)", items="a curve",
                                            default_factory=list, kw_only=True)
    layer_names: list[str] | None = schema_field(LAYER_NAMES, default=None, kw_only=True)  # probe.hooks.stacks

    def to_frame(self) -> Any:
        """A pandas DataFrame, one row per curve and step (`rows()`): the prune schema's columns. Needs pandas."""
        return frame(self.rows())

    def rows(self) -> list[dict[str, Any]]:
        """One row per (curve, step), for CSV."""
        return [{"ordering": curve.ordering, "seed": curve.seed, **{k: v for k, v in step.to_dict().items()
                                                                    if k != "removed"},
                 "removed": as_column(" ".join(step.removed))} for curve in self.curves for step in curve.steps]


class _Evaluator:
    """The metric over the probe set with a set of heads ablated together: one full forward per batch."""

    def __init__(self, loaded: LoadedModel, probe_set: ProbeSet, method: AblationMethod, metric: Metric,
                 batch_size: int) -> None:
        self.runner = sweep_runner(loaded, probe_set, "naive", method, metric, batch_size, [])
        self.scorer = self.runner.scorer
        self.counts = torch.stack([b.counted.sum(dim=(1, 2)) for b in self.runner.batches]).sum(dim=0).double()
        self.passes = 0

    def baseline(self) -> float:
        with torch.inference_mode():
            sums = reduce(operator.add, (self.runner.baseline(index) for index in range(len(self.runner.batches))))
        loss = losses(sums, self.counts, list(self.scorer.parts))[0]
        require_finite_baseline(self.runner, loss)
        return loss

    def loss(self, heads: Sequence[Head]) -> float:
        self.passes += 1
        if not heads:
            return self.baseline()
        with torch.inference_mode():
            sums = reduce(operator.add, (self.runner.sums([tuple(heads)], index)[0]
                                         for index in range(len(self.runner.batches))))
        return losses(sums, self.counts, list(self.scorer.parts))[0]


def _gate_gradients(evaluator: _Evaluator, pruned: Sequence[Head], n_layers: int, n_heads: int,
                    index: int) -> Tensor:
    """(batch, n_layers, n_heads) dL_x/dxi_h per sequence of batch `index`, the `pruned` heads ablated."""
    runner = evaluator.runner
    batch = runner.batches[index]
    outputs: dict[int, Tensor] = {}

    with torch.enable_grad():
        with ablated(runner.model, [tuple(pruned)], runner.method, batch.context), \
                attention_hooks(runner.model, {"z": keeping_graph(outputs)}, batch=batch.context):
            output = logits_of(run_model(runner.model, batch.ids, batch.mask))  # (batch, positions, vocab)
        metric = evaluator.scorer.metric
        graded = metric if metric.surrogate is None else METRICS[metric.surrogate]  # no gradient: its surrogate's
        values = graded.values(output, batch.ids, batch.reference)  # (batch, positions')
        counted = batch.counted[0].to(values.device)
        per_sequence = (values * counted).sum(dim=1) / counted.sum(dim=1).clamp(min=1)
        order = sorted(outputs)
        grads, scale = scaled_gradients(per_sequence.sum(), float(counted.sum(dim=1).max()),
                                        [outputs[layer] for layer in order])  # float16's kept in range
    gates = torch.zeros(batch.ids.shape[0], n_layers, n_heads, dtype=torch.float64)
    for layer, grad in zip(order, grads):
        if grad is not None:
            gates[:, layer, :grad.shape[2]] = (grad * outputs[layer].detach()).double().sum(dim=(1, 3)).cpu() / scale
    return gates


def importance(evaluator: _Evaluator, units: Sequence[Unit], pruned: Sequence[Head], shape: tuple[int, int]
               ) -> dict[Unit, float]:
    """Michel et al. 2019 importance of each unit, normalised by the l2 norm of its layer's units."""
    raw = torch.zeros(len(units), dtype=torch.float64)
    n_seqs = 0
    for index in range(len(evaluator.runner.batches)):
        gates = _gate_gradients(evaluator, pruned, *shape, index)  # (batch, n_layers, n_heads)
        for position, unit in enumerate(units):
            raw[position] += reduce(operator.add, (gates[:, layer, head] for layer, head in unit)).abs().sum()
        n_seqs += gates.shape[0]
    raw /= max(n_seqs, 1)
    layer_of = torch.tensor([unit[0][0] for unit in units])
    norms = torch.zeros(shape[0], dtype=torch.float64).index_add_(0, layer_of, raw.pow(2)).sqrt()
    return {unit: float(raw[i] / norms[layer_of[i]]) if norms[layer_of[i]] > 0 else 0.0 for i, unit in enumerate(units)}


def _mask(pruned: set[Head], n_layers: int, n_heads: int) -> list[list[int]]:
    return [[0 if (layer, head) in pruned else 1 for head in range(n_heads)] for layer in range(n_layers)]


# long: one loop that picks, measures and stops; splitting it would pass its six pieces of state around
def _curve(evaluator: _Evaluator, units: list[Unit], result: PruneResult, ordering: str, seed: int | None,
           choose: Callable[[list[Unit], list[Head]], list[Unit]], progress: Callable[[], None]) -> PruneCurve:
    """Prune `units` in steps in the order `choose` gives, until the loss passes `result.limit` or none is left."""
    per_step = max(1, math.ceil(result.step * len(units) - 1e-9))
    remaining, pruned = list(units), list[Head]()
    steps = [PruneStep(0, 0, 0, 0.0, result.baseline_loss, 0.0, [])]
    kept, stopped = _mask(set(), result.n_layers, result.n_heads), "every unit pruned"
    while remaining:
        chosen = choose(remaining, pruned)[:per_step]
        remaining = [unit for unit in remaining if unit not in chosen]
        pruned += [head for unit in chosen for head in unit]
        loss = evaluator.loss(pruned)
        removed = len(units) - len(remaining)
        steps.append(PruneStep(len(steps), removed, len(pruned), removed / len(units), loss,
                               loss - result.baseline_loss, [label(unit, result.layer_names) for unit in chosen]))
        progress()
        if result.limit is not None and loss > result.limit:
            stopped = f"loss {loss:.4f} passed the limit {result.limit:.4f}"
            break
        kept = _mask(set(pruned), result.n_layers, result.n_heads)
    return PruneCurve(ordering, seed, kept, steps, stopped=stopped)


def check_prune_options(orderings: Sequence[str], step: float, max_increase: float | None,
                        seeds: Sequence[int]) -> None:
    """Every option that can be judged without the model."""
    unknown = [name for name in orderings if name not in ORDERINGS]
    if unknown or not orderings:
        raise ProbeError(f"unknown ordering {unknown[0] if unknown else ''!r} in orderings: use some of "
                         f"{', '.join(ORDERINGS)}", parameter="orderings")
    if not 0 < step <= 1:
        raise ProbeError(f"step is the share of heads removed per step, in (0, 1]; got {step}", parameter="step")
    if max_increase is not None and not (math.isfinite(max_increase) and max_increase >= 0):
        raise ProbeError(f"max_increase must be a finite number >= 0, got {max_increase}", parameter="max_increase")
    if "random" in orderings and not seeds:
        raise ProbeError("the random ordering needs seeds >= 1", parameter="seeds")


@dataclass
class _Run:
    """What the orderings share: the evaluator, the units, and the passes and seconds spent."""

    loaded: LoadedModel
    probe_set: ProbeSet
    evaluator: _Evaluator
    units: list[Unit]
    shape: tuple[int, int]
    batch_size: int
    tick: Callable[[], None]
    gradient_passes: int = 0
    sweep_seconds: float = 0.0

    def chooser(self, name: str, seed: int | None) -> Callable[[list[Unit], list[Head]], list[Unit]]:
        """The remaining units in the order `name` prunes them: least important first."""
        if name == "michel":
            def by_importance(remaining: list[Unit], pruned: list[Head]) -> list[Unit]:
                scores = importance(self.evaluator, remaining, pruned, self.shape)
                self.gradient_passes += 1
                self.tick()
                return sorted(remaining, key=lambda unit: (scores[unit], unit))
            return by_importance
        if name == "sweep":  # units by their single-unit ablation delta, smallest first (one exact sweep)
            timer = time.perf_counter()
            swept = sweep_units(self.loaded, self.probe_set, self.units, method=self.evaluator.runner.method,
                                batch_size=self.batch_size)
            assert swept is not None  # a plain sweep always reports
            delta = {entry.heads: entry.delta for entry in swept.results}
            order = sorted(self.units, key=lambda unit: (delta[unit], unit))
            self.sweep_seconds = time.perf_counter() - timer
        else:
            generator = torch.Generator().manual_seed(seed if seed is not None else 0)
            order = [self.units[i] for i in torch.randperm(len(self.units), generator=generator)]
        return lambda remaining, pruned: [unit for unit in order if unit in remaining]


@reports("pruning")
def prune(loaded: LoadedModel, probe_set: ProbeSet, *, orderings: Sequence[str] = ORDERINGS, step: float = 0.1,
          max_increase: float | None = None, relative: bool = True, seeds: Sequence[int] = (0, 1, 2),
          method: str | AblationMethod = "zero", metric: str | Metric | None = None, kv_groups: bool = False,
          method_seed: int = 0, batch_size: int = 8, data: str | None = None, eval_set: ProbeSet | None = None,
          eval_data: str | None = None, progress: ProgressArg = None) -> PruneResult:
    """Pruning curves (see the module docstring): per ordering, remove `step` of the units per step until the metric
    rises past `max_increase` (relative, or absolute with `relative=False`). `method` and `metric` as in `sweep`;
    `eval_set`: measure the losses there instead of on `probe_set`, where the orderings are chosen. `progress`: True
    draws a bar, a callable gets `(done, total)` in steps."""
    started, report = time.perf_counter(), callback(progress)
    check_probe_set(probe_set, refuse="prune")
    chosen_metric = choose_metric(loaded, probe_set, metric)
    check_prune_options(orderings, step, max_increase, seeds)
    if "michel" in orderings and chosen_metric.compares:
        raise ProbeError(f"Michel importance needs a loss to differentiate; {chosen_metric.name} compares to the "
                         "unablated model (its gradient there is 0): drop the michel ordering", parameter="orderings")
    chosen = build_method(method, loaded, probe_set, seed=method_seed, batch_size=batch_size)
    evaluator = _Evaluator(loaded, probe_set, chosen, chosen_metric, batch_size)
    measure = evaluator
    if eval_set is not None:
        check_probe_set(eval_set)
        measure = _Evaluator(loaded, eval_set, evaluator.runner.method, chosen_metric, batch_size)
    units = prune_units(loaded, kv_groups)
    measure.baseline()  # the first forward pays one-off costs (finding the layers, allocations): time the second
    timer = time.perf_counter()
    baseline = measure.baseline()
    forward_seconds = max(time.perf_counter() - timer, 1e-9)
    limit = None if max_increase is None else baseline * (1 + max_increase) if relative else baseline + max_increase
    result = PruneResult(loaded.name, chosen_metric.name, evaluator.runner.method.name, data_name(probe_set, data),
                         "kv_groups" if kv_groups else "heads", len(units),
                         *layer_shape(attention_layers(loaded.model)), baseline, step,
                         limit,
                         None if eval_set is None else data_name(eval_set, eval_data),
                         layer_names=layer_names(attention_layers(loaded.model)), dtype=model_dtype(loaded))
    curves = [(name, None) for name in orderings if name != "random"] + \
        [("random", seed) for seed in seeds if "random" in orderings]
    work = Work(math.ceil(1 / step - 1e-9) * (len(curves) + ("michel" in orderings)), report)
    tick = partial(work.advance, 1)
    run = _Run(loaded, probe_set, evaluator, units, (result.n_layers, result.n_heads), batch_size, tick)
    planned = 0  # the steps counted in `total` for the curves done: a curve stopped at the limit skips the rest
    for name, seed in curves:
        result.curves.append(_curve(measure, units, result, name, seed, run.chooser(name, seed), tick))
        planned += math.ceil(1 / step - 1e-9) * (2 if name == "michel" else 1)
        work.done = max(work.done, planned) - 1
        tick()  # progress ends at its total
    result.seconds = time.perf_counter() - started
    result.costs = {"forward_seconds": round(forward_seconds, 4), "loss_passes": measure.passes,
                    "gradient_passes": run.gradient_passes, "sweep_seconds": round(run.sweep_seconds, 3),
                    "forward_equivalents": round(result.seconds / forward_seconds, 1),
                    "sweep_forward_equivalents": round(run.sweep_seconds / forward_seconds, 1)}
    return result

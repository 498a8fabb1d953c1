"""Steering through single heads (SAMD, 2025; docs/steering.md): a head's output times alpha, or any registered
intervention made with one number (`steerable()`). Values read forwards: a metric that is minus a quantity
(`Metric.forwards`) is reported as that quantity."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from probe.frames import frame, head_columns
from probe.schemas.base import Field
from probe.schemas.common import DTYPE, HEAD, HEAD_COLUMNS, LAYER, MODEL, NUMBER, SECONDS
from probe.schemas.declare import Payload, payload, published, schema_field
from probe.ablation.heads import Head, parse_heads
from probe.ablation.methods import METHODS, AblationMethod, MethodInputs, chained, method_class
from probe.ablation.metrics import Metric, choose_metric
from probe.ablation.results import AblationResult
from probe.ablation.sweep import baseline_metric, sweep
from probe.errors import ProbeError
from probe.hooks.layers import attention_layers
from probe.hooks.points import Writer
from probe.hooks.run import logits_of, run_model
from probe.hooks.stacks import layer_names
from probe.hooks.trace import Trace
from probe.inputs import ProbeSet
from probe.models import LoadedModel
from probe.provenance import model_dtype

def intervention_named(name: str, value: float) -> AblationMethod:
    """The registered intervention `name` (one of `steerable()`) made with `value`, its `parameter`."""
    chosen = method_class(name)
    if chosen.parameter is None:
        raise ProbeError(f"the {name} intervention takes no value to steer with: use one of "
                         f"{', '.join(steerable())}", parameter="intervention")
    return chosen.build(MethodInputs(value=value))


def steerable() -> list[str]:
    """The registered interventions made with one number (`AblationMethod.parameter`), in registry order."""
    return [name for name, method in METHODS.items() if method.parameter is not None]


def steer(model: nn.Module | LoadedModel, scales: Mapping[str, float] | Mapping[Head, float],
          intervention: str = "scale") -> Trace:
    """Heads intervened on while the `with` runs: `scales` maps heads ("23.3", "5.*", or (layer, head)) to the
    intervention's value; restored exactly on exit."""
    module = model if isinstance(model, nn.Module) else model.model
    chosen: dict[Head, float] = {}
    for key, value in scales.items():
        value = float(value)
        if not math.isfinite(value):
            raise ProbeError(f"the value of {key} must be a finite number, got {value}", parameter="scales")
        heads = parse_heads(key, attention_layers(module)) if isinstance(key, str) else [(int(key[0]), int(key[1]))]
        chosen.update(dict.fromkeys(heads, value))
    if not chosen:
        raise ProbeError("nothing to steer: give at least one head and its value", parameter="scales")
    return Trace(module, {"z": row_writers([(None, head, value) for head, value in chosen.items()], intervention)})


def check_values(values: Iterable[float], parameter: str = "values") -> list[float]:
    """The values as given, each finite and each once (order kept)."""
    chosen = list(dict.fromkeys(float(value) for value in values))
    if not chosen:
        raise ProbeError("give at least one value", parameter=parameter)
    bad = [value for value in chosen if not math.isfinite(value)]
    if bad:
        raise ProbeError(f"a value must be a finite number, got {bad[0]}", parameter=parameter)
    return chosen


@published("steer", 3, "Steering through single heads: the metric against an intervention's value per head (scale: "
           "alpha), every head ranked at one value, greedy continuations (probe steer --json).",
           rows="one per head and setting (the curves; --find: its ranking at its setting)",
           columns={**HEAD_COLUMNS, "setting": Field("number", "the intervention's value (scale: the alpha the head's "
                                                                "output is multiplied by)"),
                    "value": Field("number", "the measure"), "delta": Field("number", "value - baseline")},
           column_patterns={r"^(margin|accuracy)$": Field("number", "task sets: the margin or accuracy")})
class SteerResult(Payload):
    """A metric against an intervention's value per head (`curves`), every head ranked at one value (`find`), and
    greedy continuations (`generations`)."""

    @payload("steer")
    def kind(self) -> str:
        return "steer"

    model: str = schema_field(MODEL)
    dtype: str = schema_field(DTYPE)
    metric: str = schema_field("the metric")
    description: str = schema_field("what it measures", key="metric_description")

    @payload("what every value is: the metric itself, or, for a metric that is minus a quantity (logit_diff, "
             "task_margin), that quantity (logit difference, task margin), so that higher is more of the behaviour",
             key="measure")
    def measured(self) -> str:
        return self.measure or self.metric

    data: str = schema_field("what it was run on")
    baseline: float = schema_field("the measure of the model as it is")
    measure: str = ""  # what every value is: the metric's forwards quantity (logit difference), or the metric
    figures: dict[str, float] | None = schema_field("task sets: the baseline's margin and accuracy",
                                                    key="baseline_figures", default=None)
    intervention: str = schema_field("the intervention (a registered ablation method that takes a value: scale, "
                                     "...)", default="scale")
    parameter: str = schema_field("what its values are (scale: alpha)", default="alpha")
    values: list[float] = schema_field("the intervention's values of the curves", items=NUMBER, default_factory=list)
    curves: list[dict[str, Any]] = schema_field(  # per head: measure and figures at each setting
        "per head: the measure at each value", items=Field("object", "a head", fields={
            "layer": LAYER, "head": HEAD, "points": Field("array", "setting, value, delta, figures")}),
        default_factory=list)
    find: dict[str, Any] | None = schema_field(  # setting, path, and every head ranked by |delta|
        "--find: the setting, the path, every head ranked by |delta|", default=None)
    generations: dict[str, Any] | None = schema_field("greedy continuations per head and setting", default=None)
    layer_names: list[str] | None = schema_field("encoder-decoders' layer names", default=None)
    seconds: float = schema_field(SECONDS, default=0.0)

    def to_frame(self) -> Any:
        """A pandas DataFrame, one row per head and setting: the steer schema's columns. Needs pandas."""
        points = [(curve, point) for curve in self.curves for point in curve["points"]]
        if self.find is not None:
            points += [(entry, {**entry, "setting": self.find["setting"]}) for entry in self.find["ranking"]]
        return frame([{**head_columns(head["layer"], head["head"], self.layer_names), "setting": point["setting"],
                       "value": point["value"], "delta": point["delta"], **(point.get("figures") or {})}
                      for head, point in points])


def forwards(metric: Metric) -> float:
    """-1 for a metric that is minus its quantity (`Metric.forwards`), else 1: what steering's values are times."""
    return -1.0 if metric.forwards else 1.0


def _result(loaded: LoadedModel, metric: Metric, data: str, baseline: float, figures: dict[str, float] | None,
            intervention: str) -> SteerResult:
    """An empty result; `baseline` is the metric's, reported as the measure (`forwards`)."""
    return SteerResult(model=loaded.name, dtype=model_dtype(loaded), metric=metric.name,
                       description=metric.description, data=data, baseline=forwards(metric) * baseline,
                       measure=metric.forwards or metric.name, figures=figures or None, intervention=intervention,
                       parameter=method_class(intervention).parameter or "value",
                       layer_names=layer_names(attention_layers(loaded.model)) or None)


def settings(intervention: str, values: Iterable[float]) -> list[float]:
    """A curve's values in ascending order, the intervention's `identity` (the model as it is) added."""
    identity = method_class(intervention).identity
    return sorted({*check_values(values), *([] if identity is None else [identity])})


def steer_curves(loaded: LoadedModel, probe_set: ProbeSet, heads: Sequence[Head], values: Iterable[float], *,
                 intervention: str = "scale", metric: str | Metric | None = None, batch_size: int = 8,
                 stack: int | None = None, data: str | None = None) -> SteerResult:
    """For each head alone, the metric with the intervention at each value in ascending order (its identity added and
    measured once as the baseline): one exact sweep per value, values read forwards."""
    started, chosen_values = time.perf_counter(), settings(intervention, values)
    identity = method_class(intervention).identity
    chosen = choose_metric(loaded, probe_set, metric)
    heads = list(dict.fromkeys(heads))
    if not heads:
        raise ProbeError("nothing to steer: give at least one head", parameter="heads")
    methods = {value: intervention_named(intervention, value) for value in chosen_values if value != identity}
    base, figures = baseline_metric(loaded, probe_set, metric=chosen, batch_size=batch_size)
    result = _result(loaded, chosen, data or probe_set.description, base, figures, intervention)
    sign, points = forwards(chosen), {head: list[dict[str, Any]]() for head in heads}
    for value in chosen_values:
        if value not in methods:
            for head in heads:
                points[head].append({"setting": value, "value": sign * base, "delta": 0.0, "figures": figures or {}})
            continue
        swept = sweep(loaded, probe_set, heads, method=methods[value], metric=chosen, batch_size=batch_size,
                      stack=stack)
        for entry in swept.results:
            points[entry.heads[0]].append({"setting": value, "value": sign * entry.loss,
                                           "delta": sign * (entry.loss - base), "figures": entry.task})
    result.values = chosen_values
    result.curves = [{"layer": layer, "head": head, "points": points[(layer, head)]} for layer, head in heads]
    result.seconds = time.perf_counter() - started
    return result


def ranking(swept: AblationResult, sign: float = 1.0) -> list[dict[str, Any]]:
    """Every head of a sweep, the largest |delta| first (nan last), values and deltas times `sign`."""
    def key(entry: Any) -> float:
        return -abs(entry.delta) if not math.isnan(entry.delta) else math.inf

    return [{"layer": entry.layer, "head": entry.head, "value": sign * entry.loss, "delta": sign * entry.delta,
             "figures": entry.task} for entry in sorted(swept.results, key=key)]


def find_result(loaded: LoadedModel, swept: AblationResult, value: float, metric: Metric,
                intervention: str = "scale") -> SteerResult:
    """A SteerResult holding a sweep at `value` over every head, ranked, its values read forwards."""
    result = _result(loaded, metric, swept.data, swept.baseline_loss, swept.task, intervention)
    result.find = {"setting": value, "path": swept.path, "ranking": ranking(swept, forwards(metric))}
    result.seconds = swept.seconds or 0.0
    return result


def find_heads(loaded: LoadedModel, probe_set: ProbeSet, value: float, *, intervention: str = "scale",
               metric: str | Metric | None = None, **options: Any) -> SteerResult:
    """Every head under the intervention at `value` alone, ranked by how far it moves the metric; `options`: sweep."""
    chosen = choose_metric(loaded, probe_set, metric)
    method = intervention_named(intervention, check_values([value])[0])
    swept = sweep(loaded, probe_set, method=method, metric=chosen, **options)
    return find_result(loaded, swept, value, chosen, intervention)


def greedy(loaded: LoadedModel, ids: Tensor, max_new_tokens: int) -> list[list[int]]:
    """The greedy next tokens after each row of `ids`, up to each row's first end-of-sequence token: a full forward
    of the whole batch per token, no cache, every row advancing together."""
    stops: set[int] = set()  # the tokenizer's and the model config's end tokens, as `model.generate` stops on them
    for value in (getattr(loaded.tokenizer, "eos_token_id", None),
                  getattr(getattr(loaded.model, "config", None), "eos_token_id", None)):
        stops.update([value] if isinstance(value, int) else value if isinstance(value, list) else [])
    new: list[list[int]] = [[] for _ in range(ids.shape[0])]
    with torch.no_grad():
        for _ in range(max_new_tokens):
            tokens = logits_of(run_model(loaded.model, ids, None))[:, -1].float().argmax(dim=-1)
            for row, token in enumerate(tokens.tolist()):
                if not new[row] or new[row][-1] not in stops:
                    new[row].append(int(token))
            if all(row and row[-1] in stops for row in new):
                break
            ids = torch.cat([ids, tokens[:, None].to(ids.device)], dim=1)
    return new


def row_writers(rows: Sequence[tuple[int | None, Head, float]], intervention: str = "scale") -> dict[int, Writer]:
    """`z` writers steering each (row, (layer, head), value) of `rows`: that head in that row (None: every row)."""
    by_layer: dict[int, list[Writer]] = {}
    for row, (layer, head), value in rows:
        writer = intervention_named(intervention, value).writer(head, rows=None if row is None else [row])
        by_layer.setdefault(layer, []).append(writer)
    return {layer: chained(writers) for layer, writers in by_layer.items()}


def generations(loaded: LoadedModel, prompt: str, heads: Sequence[Head], values: Iterable[float], *,
                intervention: str = "scale", max_new_tokens: int = 20, seed: int = 0) -> dict[str, Any]:
    """Greedy continuations of `prompt`: the model as it is and each head alone at each value, all in one batch (a
    row per head and value, each edited in its row alone)."""
    if max_new_tokens < 1:
        raise ProbeError(f"max_new_tokens must be at least 1, got {max_new_tokens}", parameter="max_new_tokens")
    chosen_values, tokenizer = check_values(values), loaded.tokenizer
    if tokenizer is None:
        raise ProbeError(f"{loaded.name} has no tokenizer to generate text with", parameter="prompt")
    if not prompt.strip():
        raise ProbeError("the prompt is empty: give some text to continue", parameter="prompt")
    ids = torch.tensor([list(tokenizer(prompt)["input_ids"])], dtype=torch.long,
                       device=next(loaded.model.parameters()).device)
    identity = method_class(intervention).identity
    steered = [(head, value) for head in dict.fromkeys(heads) for value in chosen_values if value != identity]
    edits = [(row, head, value) for row, (head, value) in enumerate(steered, start=1)]  # row 0: as it is
    torch.manual_seed(seed)
    batch = ids.expand(len(steered) + 1, -1)
    with Trace(loaded.model, {"z": row_writers(edits, intervention)}) if edits else nullcontext():
        tokens = greedy(loaded, batch, max_new_tokens)
    texts = [str(tokenizer.decode(row)) for row in tokens]
    by_row = {(head, value): texts[row] for row, head, value in edits}
    rows = [{"layer": layer, "head": head, "setting": value,
             "text": texts[0] if value == identity else by_row[((layer, head), value)]}
            for layer, head in dict.fromkeys(heads) for value in chosen_values]
    return {"prompt": prompt, "max_new_tokens": max_new_tokens, "seed": seed, "intervention": intervention,
            "baseline": texts[0], "rows": rows}

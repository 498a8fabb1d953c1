"""Steering through single heads: a head's output multiplied by alpha (SAMD, 2025: "intervening on single heads can
steer downstream behavior"), measured or generated from.

- `steer(model, {"23.3": 2.0})`: a context manager (a `Trace` of `z` writers) around any forward or generation,
  restored exactly afterwards;
- `steer_curves`: the metric of an input as a function of alpha, per head (one exact sweep of `ScaleAblation` per
  alpha, so prefix reuse and stacked copies serve it);
- `find_heads`: every head scaled by one alpha, ranked by how far it moves the metric (the sweep itself: streaming,
  resume and torchrun shards through `probe.distributed.sharded_sweep` from the CLI);
- `generations`: greedy continuations of a prompt per head and alpha, side by side, all of them in one batch.

Values read forwards: a metric that is minus a quantity (the logit difference, a task's margin: `Metric.forwards`)
is reported as that quantity, so that higher is more of the behaviour and turning a head that writes it up raises it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from probe.frames import frame, head_columns
from probe.ablation.heads import Head, parse_heads
from probe.ablation.methods import ScaleAblation
from probe.ablation.metrics import Metric, choose_metric
from probe.ablation.results import AblationResult
from probe.ablation.sweep import baseline_metric, sweep
from probe.errors import ProbeError
from probe.hooks.layers import attention_layers
from probe.hooks.points import Writer
from probe.hooks.run import logits_of, run_model
from probe.hooks.stacks import layer_names
from probe.hooks.trace import Trace
from probe.hooks.types import HookContext
from probe.inputs import ProbeSet
from probe.models import LoadedModel
from probe.provenance import model_dtype

Scales = Mapping[str, float] | Mapping[Head, float]


def _model_of(model: nn.Module | LoadedModel) -> nn.Module:
    return model if isinstance(model, nn.Module) else model.model


def _heads_of(model: nn.Module, key: str | Head) -> list[Head]:
    if isinstance(key, str):
        return parse_heads(key, attention_layers(model))
    return [(int(key[0]), int(key[1]))]


def scale_writer(alphas: Mapping[int, float]) -> Writer:
    """A `z` writer multiplying each head of `alphas` (head -> alpha) by its own alpha, the others as they are."""
    def scale(tensor: Tensor, ctx: HookContext) -> Tensor:
        factors = torch.ones(tensor.shape[2], dtype=tensor.dtype, device=tensor.device)
        for head, alpha in alphas.items():
            if not 0 <= head < tensor.shape[2]:
                raise ProbeError(f"layer {ctx.layer} has heads 0 to {tensor.shape[2] - 1}, not {head}",
                                 parameter="heads")
            factors[head] = alpha
        return tensor * factors[:, None]

    return scale


def steer(model: nn.Module | LoadedModel, scales: Scales) -> Trace:
    """Heads scaled while the `with` runs: `scales` maps heads ("23.3", "5.*", or (layer, head)) to alpha (0: zero
    ablation; above 1: amplified). Around any forward or `model.generate`; the model is restored exactly on exit."""
    module = _model_of(model)
    by_layer: dict[int, dict[int, float]] = {}
    for key, alpha in scales.items():
        alpha = float(alpha)
        if not math.isfinite(alpha):
            raise ProbeError(f"alpha of {key} must be a finite number, got {alpha}", parameter="scales")
        for layer, head in _heads_of(module, key):
            by_layer.setdefault(layer, {})[head] = alpha
    if not by_layer:
        raise ProbeError("nothing to steer: give at least one head and its alpha", parameter="scales")
    return Trace(module, {"z": {layer: scale_writer(alphas) for layer, alphas in by_layer.items()}})


def check_alphas(alphas: Iterable[float]) -> list[float]:
    """The alphas as given, each finite and each once (order kept)."""
    chosen = list(dict.fromkeys(float(alpha) for alpha in alphas))
    if not chosen:
        raise ProbeError("give at least one alpha", parameter="alphas")
    bad = [alpha for alpha in chosen if not math.isfinite(alpha)]
    if bad:
        raise ProbeError(f"alpha must be a finite number, got {bad[0]}", parameter="alphas")
    return chosen


@dataclass
class SteerResult:
    """A metric against alpha for chosen heads (`curves`), a ranking of every head at one alpha (`find`), and greedy
    continuations per head and alpha (`generations`); alpha 1 is the model as it is (`baseline`)."""

    model: str
    dtype: str
    metric: str
    description: str
    data: str
    baseline: float  # the measure at alpha 1
    measure: str = ""  # what every value is: the metric's forwards quantity (logit difference), or the metric
    figures: dict[str, float] | None = None  # the baseline's margin and accuracy (logit difference, task sets)
    alphas: list[float] = field(default_factory=list)
    curves: list[dict[str, Any]] = field(default_factory=list)  # per head: value and figures at each alpha
    find: dict[str, Any] | None = None  # alpha, path, and every head ranked by |delta|
    generations: dict[str, Any] | None = None
    layer_names: list[str] | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """The plain payload reports render (JSON-safe but for non-finite numbers, which write_json nulls)."""
        return {"kind": "steer", "model": self.model, "dtype": self.dtype, "metric": self.metric,
                "metric_description": self.description, "measure": self.measure or self.metric, "data": self.data,
                "baseline": self.baseline,
                "baseline_figures": self.figures, "alphas": self.alphas, "curves": self.curves, "find": self.find,
                "generations": self.generations, "layer_names": self.layer_names, "seconds": self.seconds}

    def to_frame(self) -> Any:
        """A pandas DataFrame, one row per head and alpha: the curves' points, or --find's ranking at its alpha;
        layer, head, name, alpha, value, delta (and a task set's margin and accuracy): the steer schema's columns.
        Needs pandas."""
        points = [(curve, point) for curve in self.curves for point in curve["points"]]
        if self.find is not None:
            points += [(entry, {**entry, "alpha": self.find["alpha"]}) for entry in self.find["ranking"]]
        return frame([{**head_columns(head["layer"], head["head"], self.layer_names), "alpha": point["alpha"],
                       "value": point["value"], "delta": point["delta"], **(point.get("figures") or {})}
                      for head, point in points])


def forwards(metric: Metric) -> float:
    """The sign that turns the metric's values into what steering reports: -1 for a metric that is minus its
    quantity (`Metric.forwards`: the logit difference itself, higher = more of the behaviour), else 1."""
    return -1.0 if metric.forwards else 1.0


def _result(loaded: LoadedModel, metric: Metric, data: str, baseline: float,
            figures: dict[str, float] | None) -> SteerResult:
    """An empty result; `baseline` is the metric's, reported as the measure (`forwards`)."""
    return SteerResult(model=loaded.name, dtype=model_dtype(loaded), metric=metric.name,
                       description=metric.description, data=data, baseline=forwards(metric) * baseline,
                       measure=metric.forwards or metric.name, figures=figures or None,
                       layer_names=layer_names(attention_layers(loaded.model)) or None)


def steer_curves(loaded: LoadedModel, probe_set: ProbeSet, heads: Sequence[Head], alphas: Iterable[float], *,
                 metric: str | Metric | None = None, batch_size: int = 8, stack: int | None = None,
                 data: str | None = None) -> SteerResult:
    """For each head alone, the metric over `probe_set` with the head's output multiplied by each alpha (in
    ascending order, alpha 1 added): one exact sweep of ScaleAblation(alpha) per alpha; alpha 1 is the baseline,
    measured once. Values read forwards (`forwards`): the logit difference itself, not minus it."""
    started, chosen_alphas = time.perf_counter(), sorted({*check_alphas(alphas), 1.0})
    chosen = choose_metric(loaded, probe_set, metric)
    heads = list(dict.fromkeys(heads))
    if not heads:
        raise ProbeError("nothing to steer: give at least one head", parameter="heads")
    base, figures = baseline_metric(loaded, probe_set, metric=chosen, batch_size=batch_size)
    result, sign = _result(loaded, chosen, data or probe_set.description, base, figures), forwards(chosen)
    points: dict[Head, list[dict[str, Any]]] = {head: [] for head in heads}
    for alpha in chosen_alphas:
        if alpha == 1.0:
            for head in heads:
                points[head].append({"alpha": 1.0, "value": sign * base, "delta": 0.0, "figures": figures or {}})
            continue
        swept = sweep(loaded, probe_set, heads, method=ScaleAblation(alpha), metric=chosen, batch_size=batch_size,
                      stack=stack)
        for entry in swept.results:
            points[entry.heads[0]].append({"alpha": alpha, "value": sign * entry.loss,
                                           "delta": sign * (entry.loss - base), "figures": entry.task})
    result.alphas = chosen_alphas
    result.curves = [{"layer": layer, "head": head, "points": points[(layer, head)]} for layer, head in heads]
    result.seconds = time.perf_counter() - started
    return result


def ranking(swept: AblationResult, sign: float = 1.0) -> list[dict[str, Any]]:
    """Every head of a sweep, the largest |delta| first (nan last): how far one alpha moves the metric; values and
    deltas times `sign` (`forwards`)."""
    def key(entry: Any) -> float:
        return -abs(entry.delta) if not math.isnan(entry.delta) else math.inf

    return [{"layer": entry.layer, "head": entry.head, "value": sign * entry.loss, "delta": sign * entry.delta,
             "figures": entry.task} for entry in sorted(swept.results, key=key)]


def find_result(loaded: LoadedModel, swept: AblationResult, alpha: float, metric: Metric) -> SteerResult:
    """A SteerResult holding a sweep of ScaleAblation(alpha) over every head, ranked, its values read forwards."""
    result = _result(loaded, metric, swept.data, swept.baseline_loss, swept.task)
    result.find = {"alpha": alpha, "path": swept.path, "ranking": ranking(swept, forwards(metric))}
    result.seconds = swept.seconds or 0.0
    return result


def find_heads(loaded: LoadedModel, probe_set: ProbeSet, alpha: float, *, metric: str | Metric | None = None,
               **options: Any) -> SteerResult:
    """Every head scaled by `alpha` alone, ranked by how far it moves the metric; `options` go to `sweep`
    (batch_size, stack, results_path, resume, shard, progress)."""
    chosen = choose_metric(loaded, probe_set, metric)
    swept = sweep(loaded, probe_set, method=ScaleAblation(check_alphas([alpha])[0]), metric=chosen, **options)
    return find_result(loaded, swept, alpha, chosen)


def _end_tokens(loaded: LoadedModel) -> set[int]:
    """The end-of-sequence tokens: the tokenizer's and the model config's (as `model.generate` stops on them)."""
    found: set[int] = set()
    for value in (getattr(loaded.tokenizer, "eos_token_id", None),
                  getattr(getattr(loaded.model, "config", None), "eos_token_id", None)):
        found.update([value] if isinstance(value, int) else value if isinstance(value, list) else [])
    return found


def greedy(loaded: LoadedModel, ids: Tensor, max_new_tokens: int) -> list[list[int]]:
    """The greedy next tokens after each row of `ids` (rows, positions), each row up to and including its first
    end-of-sequence token: a full forward of the whole batch per token, no cache (the same on every kind of model
    probe hooks). Every row advances together, so no padding is needed; a row that has ended keeps being extended
    until all have, and its tokens after the end are dropped."""
    stops = _end_tokens(loaded)
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


def row_scale_writer(rows: Sequence[tuple[int, Head, float]]) -> dict[int, Writer]:
    """`z` writers for a batch whose rows each steer one head: `rows` (row, (layer, head), alpha); the other rows
    and heads as they are."""
    by_layer: dict[int, list[tuple[int, int, float]]] = {}
    for row, (layer, head), alpha in rows:
        by_layer.setdefault(layer, []).append((row, head, alpha))

    def writer(edits: list[tuple[int, int, float]]) -> Writer:
        def scale(tensor: Tensor, ctx: HookContext) -> Tensor:  # (batch, positions, heads, head size)
            factors = torch.ones(tensor.shape[0], tensor.shape[2], dtype=tensor.dtype, device=tensor.device)
            for row, head, alpha in edits:
                if not 0 <= head < tensor.shape[2]:
                    raise ProbeError(f"layer {ctx.layer} has heads 0 to {tensor.shape[2] - 1}, not {head}",
                                     parameter="heads")
                factors[row, head] = alpha
            return tensor * factors[:, None, :, None]

        return scale

    return {layer: writer(edits) for layer, edits in by_layer.items()}


def _prompt_ids(loaded: LoadedModel, prompt: str) -> Tensor:
    tokenizer = loaded.tokenizer
    if tokenizer is None:
        raise ProbeError(f"{loaded.name} has no tokenizer to generate text with", parameter="prompt")
    if not prompt.strip():
        raise ProbeError("the prompt is empty: give some text to continue", parameter="prompt")
    ids = list(tokenizer(prompt)["input_ids"])
    device = next(loaded.model.parameters()).device
    return torch.tensor([ids], dtype=torch.long, device=device)


def generations(loaded: LoadedModel, prompt: str, heads: Sequence[Head], alphas: Iterable[float], *,
                max_new_tokens: int = 20, seed: int = 0) -> dict[str, Any]:
    """Greedy continuations of `prompt`: the model as it is, and each head alone at each alpha, side by side, all
    in one batch (a row per head and alpha, each row's head scaled in that row alone: the same tokens as one
    generation at a time; the seed is fixed for models whose forward draws, though greedy decoding itself does
    not)."""
    if max_new_tokens < 1:
        raise ProbeError(f"max_new_tokens must be at least 1, got {max_new_tokens}", parameter="max_new_tokens")
    chosen_alphas, ids, tokenizer = check_alphas(alphas), _prompt_ids(loaded, prompt), loaded.tokenizer
    assert tokenizer is not None  # _prompt_ids refuses a model without one
    steered = [(head, alpha) for head in dict.fromkeys(heads) for alpha in chosen_alphas if alpha != 1.0]
    edits = [(row, head, alpha) for row, (head, alpha) in enumerate(steered, start=1)]  # row 0: as it is
    torch.manual_seed(seed)
    batch = ids.expand(len(steered) + 1, -1)
    if edits:
        with Trace(loaded.model, {"z": row_scale_writer(edits)}):
            tokens = greedy(loaded, batch, max_new_tokens)
    else:
        tokens = greedy(loaded, batch, max_new_tokens)
    texts = [str(tokenizer.decode(row)) for row in tokens]
    by_row = {(head, alpha): texts[row] for row, head, alpha in edits}
    rows = [{"layer": layer, "head": head, "alpha": alpha,
             "text": texts[0] if alpha == 1.0 else by_row[((layer, head), alpha)]}
            for layer, head in dict.fromkeys(heads) for alpha in chosen_alphas]
    return {"prompt": prompt, "max_new_tokens": max_new_tokens, "seed": seed, "baseline": texts[0], "rows": rows}

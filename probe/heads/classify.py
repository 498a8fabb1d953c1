"""Score every head on the probe sets and label the heads whose score passes each class's threshold."""

from __future__ import annotations

import contextlib
import math
from functools import partial
from collections.abc import Callable
from dataclasses import field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from probe.inputs import (DEFAULT_NUM_SEQS, DEFAULT_REPEAT_LEN, DEFAULT_SEED, DEFAULT_SEQ_LEN, PROBE_SETS, ProbeOptions,
                        ProbeSet, build_probe_set, real_tokens)
from probe.accel import ACCELERATORS, FusedAccumulator
from probe.errors import ProbeError, first_line
from probe.frames import frame, head_columns
from probe.heads.scores import SCORES, Batch
from probe.hooks.capture import attention_hooks
from probe.hooks.layers import AttentionLayer, attention_layers
from probe.kernels import DEFAULT_CONFIG, FusedStatistics, KernelConfig
from probe.hooks.run import run_model
from probe.hooks.stacks import layer_names
from probe.hooks.types import Handler, HookContext
from probe.models import LoadedModel
from probe.progress import Progress, ProgressArg, callback, counter, log, reports
from probe.provenance import model_dtype
from probe.schemas.base import Field
from probe.schemas.common import (CLASSES, DTYPE, HEAD, HEAD_COLUMNS, LAYER, LAYER_NAMES, MODEL, N_HEADS, N_LAYERS,
                                  NAME_RE, SCORE_BY_CLASS, THRESHOLDS, other_than)
from probe.schemas.declare import Payload, payload, published, record_field, schema_field


class Flagged(Payload, frozen=True):
    """A head a class labels, with its score."""

    layer: int = schema_field(LAYER)
    head: int = schema_field(HEAD)
    score: float = schema_field("its score")


class HeadLabels(Payload, frozen=True):
    """One head's scores by class and the classes it is labelled with."""

    layer: int = schema_field(LAYER)
    head: int = schema_field(HEAD)
    scores: dict[str, float | None] = schema_field(SCORE_BY_CLASS)
    labels: list[str] = schema_field("the classes whose threshold its score passes", items="a class")


@published("classify", 1, "Every head's score on each class's probe set, the thresholds, and the labels they give "
           "(probe classify --json).", rows="one per head, layer by layer",
           columns=(CLASSIFY_COLUMNS := {
               **HEAD_COLUMNS, "labels": Field("string", "the classes it is labelled with, comma-separated")}),
           column_patterns={other_than(CLASSIFY_COLUMNS): Field(
               "number", "the head's score of this class (a column per class)")})
class Classification(Payload):
    """Scores of every head, the thresholds used, and which probe sets produced them."""

    model: str = schema_field(MODEL)
    n_layers: int = schema_field(N_LAYERS)
    n_heads: int = schema_field(N_HEADS)
    layer_names: list[str] | None = schema_field(LAYER_NAMES, default=None, kw_only=True)
    path: str = schema_field("how the scores were computed: the name of the fast path's backend (one of "
                             "probe.kernels.BACKENDS), blocked, or which layers went which way", required=False,
                             default="", kw_only=True)
    dtype: str = schema_field(DTYPE, default="float32", kw_only=True)  # docs/precision.md: how far half precision lies
    scores: dict[str, Tensor]  # name -> (n_layers, n_heads)
    thresholds: dict[str, float] = schema_field(THRESHOLDS)

    @payload(CLASSES.description, patterns=CLASSES.patterns)
    def classes(self) -> dict[str, dict[str, Any]]:
        """What each class scored means: its summary, letter, probe set and default threshold."""
        return {name: SCORES[name].describe() if name in SCORES else self.extra_classes[name]
                for name in self.scores if name in SCORES or name in self.extra_classes}

    probe_sets: dict[str, dict[str, Any]] = schema_field(
        "each probe set used: its name, description, size and seed", default_factory=dict,
        patterns={NAME_RE: Field("object", "a probe set's description")})
    extra_classes: dict[str, dict[str, Any]] = field(default_factory=dict)  # classes scored outside SCORES

    @payload("per class, the heads labelled, highest score first", key="flagged", patterns={NAME_RE: Field(
        "array", "the heads labelled", items=record_field(Flagged, "a labelled head"))})
    def flagged_heads(self) -> dict[str, list[Flagged]]:
        """Per class, the heads labelled, highest score first (scores rounded to 6 places)."""
        return {name: [Flagged(layer, head, round(score, 6)) for layer, head, score in self.flagged(name)]
                for name in self.scores}

    not_applicable: dict[str, list[int]] = schema_field(
        "per class, the layers it does not apply to (their scores are null)", required=False, default_factory=dict,
        kw_only=True)

    @payload("every head, layer by layer", key="heads", items="one head")
    def head_labels(self) -> list[HeadLabels]:
        """Every head's scores (rounded to 6 places; None where its class does not apply) and labels."""
        return [HeadLabels(layer, head, {name: None if layer in self.not_applicable.get(name, ()) else
                                         round(float(score[layer, head]), 6) for name, score in self.scores.items()},
                           self.labels(layer, head))
                for layer in range(self.n_layers) for head in range(self.n_heads)]

    def labels(self, layer: int, head: int) -> list[str]:
        return [name for name, score in self.scores.items() if float(score[layer, head]) > self.thresholds[name]]

    def flagged(self, name: str) -> list[tuple[int, int, float]]:
        """(layer, head, score) of the heads labelled `name`, highest score first."""
        score = self.scores[name]
        heads = [(layer, head, float(score[layer, head])) for layer in range(self.n_layers)
                 for head in range(self.n_heads) if float(score[layer, head]) > self.thresholds[name]]
        return sorted(heads, key=lambda item: -item[2])

    def to_frame(self) -> Any:
        """A pandas DataFrame, one row per head: layer, head, its name (`L5H1`, never read as a number; `x1.2` on an
        encoder-decoder), each class's score, and its labels (comma-separated); the classify schema's columns. Needs
        pandas."""
        return frame([{**head_columns(layer, head, self.layer_names),
                       **{name: float(score[layer, head]) for name, score in self.scores.items()},
                       "labels": ",".join(self.labels(layer, head))}
                      for layer in range(self.n_layers) for head in range(self.n_heads)])

    def __repr__(self) -> str:
        """A short summary (the dataclass' own repr would print every score tensor)."""
        counts = ", ".join(f"{name} {len(self.flagged(name))}" for name in self.scores)
        return f"Classification({self.model!r}: {self.n_layers} layers x {self.n_heads} heads; flagged: {counts})"

    def _repr_html_(self) -> str:
        from probe.reports.html import classification_page  # reports render; the library never needs them otherwise

        return classification_page(self.to_dict(), embed_plotly=False)


class HeadScores(dict):
    """{name: (n_layers, n_heads) scores}, and `path`: how they were computed (FusedAccumulator.path)."""

    path: str = ""


PATHS = ("auto", "lse", "blocked")


@reports("scoring heads")
def score_heads(loaded: LoadedModel, probe_set: ProbeSet, names: list[str], *, batch_size: int = 8,
                query_block: int | None = None, progress: ProgressArg = None, path: str = "auto",
                config: KernelConfig = DEFAULT_CONFIG) -> HeadScores:
    """Run the probe set through the model in batches and reduce each layer's attention into the named scores.
    `path`: "lse" reads each layer's fused statistics (probe.kernels; layers no backend serves go blocked, and the
    result's `path` says which), "blocked" reduces blocks of eager weights everywhere, "auto" is "lse" for the scores
    with an accelerator (probe.accel) and a second, blocked pass for the rest. `config` tunes the fast path (never a
    number). `progress=True` draws a bar on stderr; a callable gets `(done, total)` in layers of batches."""
    report = callback(progress)
    passes = score_passes(names, path)
    steps = len(probe_set.batches(batch_size)) * len(attention_layers(loaded.model))
    total = steps * len(passes)
    found: dict[str, Tensor] = {}
    paths = []
    for index, (chosen, use_lse) in enumerate(passes):
        counted = None if report is None else partial(_counted_from, report, index * steps, total)
        scored = _score_pass(loaded, probe_set, chosen, use_lse, batch_size=batch_size, query_block=query_block,
                             progress=counted, config=config)
        found.update(scored)
        paths.append(scored.path if index == 0 else f"{scored.path} for {', '.join(chosen)} (no fast path)")
    scores = HeadScores({name: found[name] for name in names})
    scores.path = "; ".join(paths)
    return scores


def score_passes(names: list[str], path: str) -> list[tuple[list[str], bool]]:
    """The forward passes `score_heads` runs: (the scores read in it, whether from the fused statistics)."""
    if path not in PATHS:
        raise ProbeError(f"path must be one of {', '.join(PATHS)}, got {path!r}", parameter="path")
    slow = [name for name in names if name not in ACCELERATORS]
    if path == "lse" and slow:
        raise ProbeError(f"no fast path for {', '.join(slow)}: use path='blocked' or 'auto'", parameter="path")
    fast = [name for name in names if name not in slow]
    if path == "blocked" or not fast:
        return [(names, False)]
    return [(fast, True), (slow, False)] if slow else [(names, True)]


def _score_pass(loaded: LoadedModel, probe_set: ProbeSet, names: list[str], use_lse: bool, *, batch_size: int,
                query_block: int | None, progress: Progress | None, config: KernelConfig) -> HeadScores:
    """One pass of score_heads over the probe set: from the fused statistics (`use_lse`) or blocks of weights."""
    layers = attention_layers(loaded.model)
    accumulator = FusedAccumulator(names, len(layers), max(layer.n_heads for layer in layers), config)
    batches = probe_set.batches(batch_size)
    read_batches(loaded, batches, accumulator, use_lse, lambda ids, mask: Batch(
        valid=real_tokens(ids, mask), offset=probe_set.offset, repeat_len=probe_set.repeat_len),
                 counter(progress, len(batches) * len(layers)), config=config, query_block=query_block)
    scores = HeadScores(accumulator.result())
    scores.path = accumulator.path()
    return scores


def read_batches(loaded: LoadedModel, batches: list[tuple[Tensor, Tensor | None]], sums: Any, fast: bool,
                 batch_of: Callable[[Tensor, Tensor | None], Any], step: Callable[[], None], *,
                 config: KernelConfig, query_block: int | None = None) -> None:
    """Every batch's forward into `sums` (its `batch` set to batch_of(ids, mask) first): blocks of weights to
    `sums.update(layer, start, weights)`, and where `fast` fused statistics to `sums(layer, statistics)` and
    `sums.blocked(layer, reason)`; `step()` once per layer read. Each forward ends once every layer's attention is
    read: the last layer's MLP, the final norm and the head change nothing read."""
    read: set[int] = set()  # layers of this batch whose attention is read to the end
    stop = _stop_when_read(loaded.model, len(attention_layers(loaded.model)), read)

    def on_weights(weights: Tensor, ctx: HookContext) -> None:
        sums.update(ctx.layer, ctx.start, weights)
        if ctx.start + weights.shape[2] >= weights.shape[3]:
            step()
            stop(ctx.layer)

    def on_lse(attention: FusedStatistics, ctx: HookContext) -> None:
        sums(ctx.layer, attention)
        step()
        stop(ctx.layer)

    def blocked(reason: str, ctx: HookContext) -> None:
        sums.blocked(ctx.layer, reason)

    points: dict[str, Handler] = {"pattern": on_weights, **({"lse": on_lse, "blocked": blocked} if fast else {})}
    with torch.no_grad(), attention_hooks(loaded.model, points, query_block=query_block, config=config):
        for ids, mask in batches:
            sums.batch = batch_of(ids, mask)
            read.clear()
            with contextlib.suppress(_EveryLayerRead):  # what follows the last attention changes nothing read
                forward(loaded.model, ids, mask)


class _EveryLayerRead(BaseException):
    """Raised from the hook of the batch's last attention to be read: the rest of the forward is not needed. A
    BaseException, so that no model's own `except Exception` takes it for a failure."""


def _stop_when_read(model: torch.nn.Module, n_layers: int, read: set[int]) -> Callable[[int], None]:
    """A callable marking a layer read that ends the forward once every layer is (not for models dispatched by
    accelerate, whose hooks move weights back only when a module's forward returns)."""
    dispatched = getattr(model, "hf_device_map", None) is not None

    def mark(layer: int) -> None:
        read.add(layer)
        if len(read) == n_layers and not dispatched:
            raise _EveryLayerRead

    return mark


def forward(model: torch.nn.Module, ids: Tensor, mask: Tensor | None) -> Any:
    """run_model, with a model's own failure turned into one line (custom models fail in their own ways)."""
    try:
        return run_model(model, ids, mask, logits=False)  # scores read attention only
    except (ProbeError, KeyboardInterrupt):
        raise
    except Exception as error:
        hint, parameter = _failure_hint(model, int(ids.shape[-1]))
        raise ProbeError(f"the model's forward failed on a batch of shape {tuple(ids.shape)}: "
                         f"{type(error).__name__}: {first_line(error)} ({hint})", parameter=parameter) from error


def _failure_hint(model: torch.nn.Module, length: int) -> tuple[str, str]:
    """(the likely cause of a forward's failure, the parameter to change): the length only where it can be at fault;
    value heads of their own size (multi-head latent attention) where a kernel may want them equal."""
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    known = isinstance(context, int)
    if isinstance(context, int) and length > context:
        return f"longer than its context of {context}: try a smaller seq_len", "seq_len"
    try:
        layers = attention_layers(model)  # found already where a forward ran under probe's hooks
    except ProbeError:
        layers = []
    uneven = next((layer for layer in layers if layer.value_dim != layer.head_dim), None)
    if uneven is not None:
        return (f"value heads of {uneven.value_dim} against query/key heads of {uneven.head_dim}: an attention kernel "
                "that needs equal sizes fails on them; path='blocked' takes them"), "path"
    if known:
        return f"not the length: {length} tokens fit its context of {context}", "model"
    return "longer than its context? try a smaller seq_len", "seq_len"


def _thresholds(names: list[str], thresholds: dict[str, float] | None, batch_size: int) -> dict[str, float]:
    """The threshold of each class in `names`: its default, or the finite number given; bad input refused."""
    for parameter, given in (("scores", names), ("thresholds", list(thresholds or {}))):
        unknown = [name for name in given if name not in SCORES]
        if unknown:
            raise ProbeError(f"unknown head class {unknown[0]!r}: choose from {', '.join(SCORES)}",
                             parameter=parameter)
    for name, value in (thresholds or {}).items():
        if not math.isfinite(value):
            raise ProbeError(f"thresholds: the threshold of {name} must be a finite number, got {value}",
                             parameter="thresholds")
    if batch_size < 1:
        raise ProbeError(f"batch_size must be at least 1, got {batch_size}", parameter="batch_size")
    return {name: SCORES[name].threshold for name in names} | (thresholds or {})


def _scored(scores: list[str] | None, thresholds: dict[str, float] | None) -> list[str]:
    """The classes to score: those named (None: the registry's `by_default` ones), and each class given a threshold
    (asking a class's threshold is asking for its labels)."""
    names = [name for name, score in SCORES.items() if score.by_default] if scores is None else list(scores)
    return names + [name for name in thresholds or {} if name in SCORES and name not in names]


@reports("classifying heads")
def classify(
    loaded: LoadedModel,
    *,
    data: str | Path | None = None,
    seq_len: int = DEFAULT_SEQ_LEN,
    num_seqs: int = DEFAULT_NUM_SEQS,
    repeat_len: int = DEFAULT_REPEAT_LEN,
    seed: int = DEFAULT_SEED,
    thresholds: dict[str, float] | None = None,
    scores: list[str] | None = None,
    batch_size: int = 8,
    query_block: int | None = None,
    progress: ProgressArg = None,
    path: str = "auto",
) -> Classification:
    """Score every head of the model for each class in `scores` (default: those of SCORES scored by default) and
    each class given one of `thresholds`, and label them, each class on the probe set it names (`Score.probe`).
    `progress=True` draws a bar on stderr; a callable gets `(done, total)`. `path`: how scores are computed
    (score_heads): "auto" (the log-sum-exp where it can), "lse" or "blocked"."""
    progress = callback(progress)
    names = _scored(scores, thresholds)
    chosen = _thresholds(names, thresholds, batch_size)
    layers = attention_layers(loaded.model)
    options = ProbeOptions(data=data, seq_len=seq_len, num_seqs=num_seqs, repeat_len=repeat_len, seed=seed)
    needed = {SCORES[name].probe for name in names}
    order = [set_name for set_name in PROBE_SETS if set_name in needed] + sorted(needed - set(PROBE_SETS))
    by_set = {set_name: [name for name in names if SCORES[name].probe == set_name] for set_name in order}
    sets = {set_name: build_probe_set(set_name, loaded, options) for set_name in order}
    steps = {set_name: -(-probe_set.input_ids.shape[0] // batch_size) * len(layers)
             * len(score_passes(by_set[set_name], path)) for set_name, probe_set in sets.items()}
    total = sum(steps.values())
    results: dict[str, Tensor] = {}
    paths: dict[str, str] = {}
    done = 0
    for set_name, probe_set in sets.items():
        report = None if progress is None else partial(_counted_from, progress, done, total)
        scored = score_heads(loaded, probe_set, by_set[set_name], batch_size=batch_size, query_block=query_block,
                             progress=report, path=path)
        results.update(scored)
        paths[set_name] = scored.path
        done += steps[set_name]
    log.info("classified %d classes on %s", len(names), ", ".join(sets))
    not_applicable = _not_applicable(names, layers, results)
    return Classification(
        model=loaded.name,
        n_layers=len(layers),
        n_heads=max(layer.n_heads for layer in layers),
        scores={name: results[name].float() for name in names},
        thresholds=chosen,
        probe_sets={name: probe_set.to_dict() | {"description": probe_set.description, "path": paths[name]}
                    for name, probe_set in sets.items()},
        layer_names=layer_names(layers),
        not_applicable=not_applicable,
        path=paths[order[0]] if len(set(paths.values())) == 1 else "; ".join(f"{k}: {v}" for k, v in paths.items()),
        dtype=model_dtype(loaded),
    )


def _counted_from(progress: Progress, done: int, total: int, step: int, _total: int) -> None:
    """Progress of one part of a longer count: its `step` counted on from `done` of `total`."""
    progress(done + step, total)


def _not_applicable(names: list[str], layers: list[AttentionLayer],
                    results: dict[str, Tensor]) -> dict[str, list[int]]:
    """Cross-attention layers (queries: decoder positions, keys: encoder positions) for each class whose definition
    needs keys from the queries' own sequence (previous token, induction, ...): scored NaN, reported n/a (null).
    The sink score applies (`Score.on_cross`)."""
    cross = [layer.index for layer in layers if layer.stack == "cross"]
    skipped = {name: cross for name in names if cross and not SCORES[name].on_cross}
    for name, indices in skipped.items():
        results[name][indices] = float("nan")
    return skipped

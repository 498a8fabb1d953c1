"""`kv_heads`: which KV heads a long-context cache can shrink to sink + recent keys (streaming) and which need the
full cache (retrieval), per query head and per KV head, with the check that makes such a map trustworthy.

- Scores, one forward per needle prompt (probe.inputs.needle): the retrieval score (Wu et al. 2024) and the
  streaming score
  (StreamingLLM's sink + recent mass, Xiao et al. 2023), both from the score registry (probe.heads.scores).
- A KV head streams only if every query head sharing it can: its retrieval score is the max over its group, its
  streaming score the min.
- Labels, by default from a calibrated budget: the largest number k of KV heads, streamed in the order below, whose
  measured point keeps the needle accuracy at the unablated model's level and the natural-text loss change within
  `max_loss_increase` (+0.03), on needle prompts and texts that neither the scores nor the curve read; found by
  bisection over k (about log2 of the KV heads' count points, each measured), assuming the acceptable k are a
  prefix. A fixed budget on request: the `full_fraction` of KV heads that retrieval needs most stay full (or, with
  thresholds, a head is full when its retrieval score passes `retrieval_threshold` or its streaming score falls
  below `streaming_threshold`).
- Order: retrieval ascending, ties by streaming descending (a streaming-first order would stream retrieval heads
  early: in plain text they too put most of their mass on sink + recent keys).
- The curve: the first k KV heads of that order windowed (WindowAblation), k = 0 .. all, the loss change on natural
  text and the needle accuracy at each k, against random orders; on needle prompts other than the scored ones.
- The cache a streaming head keeps: 64 sink + 256 recent keys by default (KV_SINK, DEFAULT_RECENT), the cache that
  DuoAttention deploys its streaming heads with (Xiao et al. 2024; its evaluations run `--sink_size 64
  --recent_size 256`), since DuoAttention is what the exported map is for. The map is calibrated for that cache:
  a smaller one (StreamingLLM's 4 sink keys, `sink=4`) loses more per streamed head, and its budget is smaller.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch
from torch import Tensor

from probe.frames import frame, head_rows
from probe.ablation.editor import ablated
from probe.ablation.sweep import sweep
from probe.ablation.window import WindowAblation
from probe.hooks.layers import attention_layers
from probe.hooks.run import logits_of, run_model
from probe.inputs import DEFAULT_DEPTHS, NeedleOptions, NeedleSet, ProbeSet, natural_set, needle_set
from probe.errors import ProbeError
from probe.overflow import forwards, overflowed, require_finite
from probe.heads.scores import (DEFAULT_RECENT, DEFAULT_SINK, NeedleBatch, retrieval_hits, retrieval_rows,
                                streaming_from_lse, streaming_score)
from probe.hooks.capture import attention_hooks
from probe.hooks.stacks import is_encoder_decoder
from probe.hooks.types import Handler, HookContext
from probe.kernels import FusedStatistics
from probe.kernels.fused import uploaded
from probe.models import LoadedModel
from probe.progress import Progress
from probe.provenance import model_dtype
CURVE_SEED_OFFSET = 1000  # the curve's needle prompts: another seed than the scored ones
BUDGET_SEED_OFFSET = 2000  # the budget's needle prompts: another seed than the scored ones and the curve's
DEFAULT_FULL_FRACTION = 0.25  # the fixed budget's default, where a fixed budget is asked for
DEFAULT_MAX_LOSS_INCREASE = 0.03
KV_SINK = 64  # sink keys of a streaming head: DuoAttention's deployed cache (64 sink + 256 recent keys)


@dataclass
class NeedleRun:
    """One teacher-forced forward of needle prompts: per prompt whether every key token was predicted, the fraction
    that was, and (when scored) the per-head retrieval and streaming sums."""

    exact: list[bool]
    token_accuracy: list[float]


def _answer_rows(sources: Tensor) -> Tensor:
    """The query positions any prompt of the batch predicts a key token at, ascending (1-D)."""
    return (sources >= 0).any(dim=0).nonzero().squeeze(1)


def _predictions(output: Any, ids: Tensor, rows: Tensor, sources: Tensor) -> Tensor:
    """(b, len(rows)) bool: the model's argmax at each row is the next token (only rows with a source matter)."""
    logits = logits_of(output)  # (b, rows or n, vocab)
    if logits.shape[1] != len(rows):
        logits = logits[:, rows.to(logits.device)]
    predicted = logits.argmax(dim=-1).cpu()
    return (predicted == ids[:, rows + 1]) & (sources[:, rows] >= 0)


def _accuracy(sources: Tensor, correct: Tensor) -> NeedleRun:
    counted = sources >= 0  # (b, rows)
    totals = counted.sum(dim=1).clamp(min=1)
    right = (correct & counted).sum(dim=1)
    return NeedleRun(exact=[bool(r == t) for r, t in zip(right.tolist(), counted.sum(dim=1).tolist())],
                     token_accuracy=(right.double() / totals).tolist())


def needle_accuracy(loaded: LoadedModel, needles: NeedleSet, *, batch_size: int = 1) -> NeedleRun:
    """Teacher-forced needle accuracy of the model as it is (with whatever hooks the caller has installed)."""
    exact, tokens = [], []
    for first in range(0, needles.input_ids.shape[0], batch_size):
        ids, mask, sources = _rows(needles, first, batch_size)
        rows = _answer_rows(sources)
        with torch.no_grad():
            output = run_model(loaded.model, ids, mask, logits=rows)
        run = _accuracy(sources[:, rows], _predictions(output, ids, rows, sources))
        exact += run.exact
        tokens += run.token_accuracy
    return NeedleRun(exact, tokens)


def _rows(needles: NeedleSet, first: int, batch_size: int) -> tuple[Tensor, Tensor | None, Tensor]:
    ids = needles.input_ids[first:first + batch_size]
    sources = needles.sources[first:first + batch_size]
    mask = None if needles.attention_mask is None else needles.attention_mask[first:first + batch_size]
    if mask is not None:
        length = int(mask.sum(dim=1).max())
        ids, mask, sources = ids[:, :length], mask[:, :length], sources[:, :length]
    return ids, mask, sources


class _Scorer:
    """Per-layer streaming sums and the top key of each answer row, kept on the attention's device during one forward
    (nothing is read back inside it: `fetched` copies them to the host once the forward is done)."""

    def __init__(self, n_layers: int, sink: int, recent: int) -> None:
        self.streaming = partial(streaming_score, sink=sink, recent=recent)
        self.streaming_fast = partial(streaming_from_lse, sink=sink, recent=recent)
        self.paths: dict[int, str] = {}  # layers whose weights went the blocked way, and why
        self.stream_sums: dict[int, Tensor] = {}
        self.stream_counts: dict[int, Tensor] = {}
        self.tops: dict[int, list[Tensor]] = {}  # (b, h, answer rows) each row's most-attended key, per part
        self.batch: NeedleBatch | None = None
        self.rows = torch.empty(0, dtype=torch.long)

    def _stream(self, layer: int, sums: Tensor, counts: Tensor) -> None:
        """Add a layer's streaming sums and counts where its earlier ones are (on the device)."""
        if layer in self.stream_sums:
            sums = self.stream_sums[layer] + sums.to(self.stream_sums[layer].device)
            counts = self.stream_counts[layer] + counts.to(self.stream_counts[layer].device)
        self.stream_sums[layer], self.stream_counts[layer] = sums, counts

    def on_lse(self, attention: FusedStatistics, ctx: HookContext) -> None:
        """The fast path (the `lse` point): the streaming band and the answer rows' top keys from the log-sum-exp."""
        layer, batch = ctx.layer, self.batch
        assert batch is not None
        self._stream(layer, *self.streaming_fast(attention, batch))
        if len(self.rows):  # (b, h, answer rows): the kernel's top keys, or argmax of the rows computed whole
            device = attention.lse.device
            rows = batch.memo(("answer rows", str(device)), lambda: uploaded(self.rows, device))  # once per prompt
            self.tops.setdefault(layer, []).append(attention.row_tops(rows))

    def blocked(self, reason: str, ctx: HookContext) -> None:
        """This layer's weights come to on_weights instead (its logits cannot be rebuilt from the log-sum-exp)."""
        self.paths[ctx.layer] = reason

    def on_weights(self, weights: Tensor, ctx: HookContext) -> None:
        """The blocked path (the `pattern` point): the same from a block of weights."""
        layer, start = ctx.layer, ctx.start
        assert self.batch is not None
        sums, counts = self.streaming(weights, start, self.batch)
        self._stream(layer, sums.to(weights.device), counts.to(weights.device))
        inside = self.rows[(self.rows >= start) & (self.rows < start + weights.shape[2])]
        if len(inside):  # (b, h, rows in this block)
            self.tops.setdefault(layer, []).append(weights[:, :, (inside - start).to(weights.device)].argmax(dim=-1))

    def fetched(self) -> tuple[dict[int, Tensor], dict[int, Tensor], dict[int, Tensor]]:
        """(streaming sums, counts, answer rows' top keys (b, h, rows)) per layer, on the host: after the forward."""
        return (_fetched(self.stream_sums), _fetched(self.stream_counts),
                _fetched({layer: torch.cat(parts, dim=2) for layer, parts in self.tops.items()}))


def _fetched(parts: dict[int, Tensor]) -> dict[int, Tensor]:
    """{layer: tensor} on the host, one copy per device and dtype (a copy per layer would wait once per layer)."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for layer, part in parts.items():
        groups.setdefault((part.device, part.dtype), []).append(layer)
    out = {}
    for layers in groups.values():
        flat = torch.cat([parts[layer].reshape(-1) for layer in layers]).cpu()
        for layer, piece in zip(layers, flat.split([parts[layer].numel() for layer in layers])):
            out[layer] = piece.view(parts[layer].shape)
    return out


def score_needles(loaded: LoadedModel, needles: NeedleSet, *, sink: int = DEFAULT_SINK,
                  recent: int = DEFAULT_RECENT, progress: Progress | None = None,
                  fast: bool = True) -> tuple[Tensor, Tensor, NeedleRun]:
    """(retrieval (n_layers, n_heads), streaming (n_layers, n_heads), the model's own needle accuracy), one forward
    per prompt: streaming sums and the top key of each answer row of each layer's attention are kept on the device
    as the layers pass (`fast`: from a fused backend's statistics, probe.kernels, where a layer allows it; else from
    blocks of weights), nothing read back inside the forward; the retrieval score (SCORES["retrieval"]'s definition)
    is reduced from those top keys once the logits say which rows were predicted."""
    layers = attention_layers(loaded.model)
    n_layers, n_heads = len(layers), max(layer.n_heads for layer in layers)
    retrieval_sum, retrieval_prompts = torch.zeros(n_layers, n_heads, dtype=torch.float64), 0
    stream_sum = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    stream_count = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    exact, tokens = [], []
    total, finite = needles.input_ids.shape[0], []
    for index in range(total):
        ids, mask, sources = _rows(needles, index, 1)
        scorer = _Scorer(n_layers, sink, recent)
        scorer.rows = _answer_rows(sources)
        valid = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
        scorer.batch = NeedleBatch(valid=valid, offset=needles.offset, repeat_len=None)
        points: dict[str, Handler] = {"pattern": scorer.on_weights,
                                      **({"lse": scorer.on_lse, "blocked": scorer.blocked} if fast else {})}
        with torch.no_grad(), attention_hooks(loaded.model, points):
            output = run_model(loaded.model, ids, mask, logits=scorer.rows)
        finite.append(torch.isfinite(logits_of(output)).all())  # on the device: read once, after the last prompt
        correct = _predictions(output, ids, scorer.rows, sources)
        run = _accuracy(sources[:, scorer.rows], correct)
        exact += run.exact
        tokens += run.token_accuracy
        sums, counts, tops = scorer.fetched()
        prompt_scores = _retrieval_of_prompt(tops, sources[:, scorer.rows], correct, n_layers, n_heads)
        if prompt_scores is not None:
            retrieval_sum += prompt_scores
            retrieval_prompts += 1
        for layer in sums:
            stream_sum[layer] += sums[layer]
            stream_count[layer] += counts[layer]
        if progress is not None:
            progress(index + 1, total)
    retrieval, streaming = retrieval_sum / max(retrieval_prompts, 1), stream_sum / stream_count.clamp(min=1)
    if not ((not finite or bool(torch.stack(finite).all())) and bool(torch.isfinite(streaming).all())):
        _refuse_overflow(loaded, needles)
    return retrieval, streaming, NeedleRun(exact, tokens)


def _refuse_overflow(loaded: LoadedModel, needles: NeedleSet) -> None:
    """Streaming scores or logits that are NaN because the model's own forward overflowed (probe.overflow)."""
    runs = [partial(run_model, loaded.model, *_rows(needles, index, 1)[:2]) for index in range(len(needles.input_ids))]
    error = overflowed("the needle prompts' streaming scores or logits", loaded.model, runs)
    if error is not None:
        raise error


def _retrieval_of_prompt(tops: dict[int, Tensor], sources: Tensor, correct: Tensor, n_layers: int,
                         n_heads: int) -> Tensor | None:
    """(n_layers, n_heads) retrieval score of one prompt from each answer row's most-attended key (b, h, rows), taken
    during the forward and read here, after it; None where the model copied no key token correctly. SCORES
    ["retrieval"]'s own definition (retrieval_rows, retrieval_hits: Wu et al. 2024): over the rows whose target is
    copied from the needle and predicted correctly, the fraction whose top key is that needle token."""
    selected = retrieval_rows(sources, correct)  # (b, rows)
    if not bool(selected.any()):
        return None
    out = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    for layer, top in tops.items():
        out[layer, :top.shape[1]] = retrieval_hits(top.transpose(1, 2)[selected], sources[selected]) / selected.sum()
    return out


def kv_groups(loaded: LoadedModel) -> tuple[int, int]:
    """(query heads, KV heads) per layer: grouped-query attention shares one KV head among n_heads / n_kv query
    heads, consecutive ones (transformers' repeat_kv order)."""
    layers = attention_layers(loaded.model)
    n_heads = max(layer.n_heads for layer in layers)
    n_kv = max(getattr(layer, "n_kv_heads", None) or n_heads for layer in layers)
    if n_heads % n_kv:
        raise ProbeError(f"{n_heads} query heads do not split into {n_kv} KV groups")
    return n_heads, n_kv


def aggregate(scores: Tensor, n_kv: int, how: str) -> Tensor:
    """(n_layers, n_heads) per query head -> (n_layers, n_kv) per KV head: "max" or "min" over each group."""
    grouped = scores.reshape(scores.shape[0], n_kv, scores.shape[1] // n_kv)
    return grouped.amax(dim=2) if how == "max" else grouped.amin(dim=2)


def stream_order(retrieval: Tensor, streaming: Tensor) -> list[tuple[int, int]]:
    """KV heads (layer, kv_head), the one retrieval needs least first: retrieval ascending, ties by streaming
    descending, then by position."""
    heads = [(layer, kv) for layer in range(retrieval.shape[0]) for kv in range(retrieval.shape[1])]
    return sorted(heads, key=lambda h: (round(float(retrieval[h]), 6), -round(float(streaming[h]), 6), h))


RETRIEVAL_FLOOR = 0.1  # a KV head retrieves (for the loss order) when its retrieval score passes this
ORDERS = ("retrieval", "loss")
"""How KV heads are ordered for streaming: retrieval ascending (stream_order), or by the loss change each causes
streamed alone, retrieving heads last (loss_order: one exact window-ablation sweep of every KV head)."""


def loss_order(loaded: LoadedModel, kv_retrieval: Tensor, texts: ProbeSet, window: WindowAblation, *,
               batch_size: int = 1, progress: Progress | None = None) -> tuple[list[tuple[int, int]], list[float]]:
    """KV heads ordered by the loss change each causes when it alone streams (an exact window-ablation sweep of
    every KV group on `texts`), retrieval-aware: the heads whose retrieval score passes RETRIEVAL_FLOOR go last,
    by retrieval. Returns the order and each head's loss change, in order."""
    n_layers, n_kv = kv_retrieval.shape
    group = attention_layers(loaded.model)[0].n_heads // n_kv
    heads = [(layer, kv) for layer in range(n_layers) for kv in range(n_kv)]
    swept = sweep(loaded, texts, [], groups=[tuple(query_heads([h], group)) for h in heads], method=window,
                  batch_size=batch_size, progress=progress)
    change = {(result.heads[0][0], result.heads[0][1] // group): result.delta for result in swept.results}
    retrieves = {h: float(kv_retrieval[h]) > RETRIEVAL_FLOOR for h in heads}
    order = sorted(heads, key=lambda h: (retrieves[h], float(kv_retrieval[h]) if retrieves[h] else change[h], h))
    return order, [round(change[h], 6) for h in order]


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


def query_heads(kv_heads: list[tuple[int, int]], group: int) -> list[tuple[int, int]]:
    """The query heads (layer, head) that share the given KV heads."""
    return [(layer, kv * group + offset) for layer, kv in kv_heads for offset in range(group)]


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


def curve_steps(n_kv_total: int, steps: int) -> list[int]:
    """k = 0 .. n_kv_total in about `steps` even steps."""
    if steps < 1:
        raise ProbeError(f"steps must be at least 1, got {steps}", parameter="steps")
    return sorted({round(i * n_kv_total / steps) for i in range(steps + 1)})


@dataclass
class _CurveInputs:
    texts: Tensor  # (n, length) natural text
    needles: NeedleSet  # prompts other than the scored ones
    group: int
    method: WindowAblation


def _point(loaded: LoadedModel, inputs: _CurveInputs, streamed: list[tuple[int, int]],
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


def stream_curve(loaded: LoadedModel, order: list[tuple[int, int]], inputs: _CurveInputs, ks: list[int],
                 seeds: list[int], progress: Progress | None = None, *,
                 stop_below: float | None = DEFAULT_MAX_LOSS_INCREASE) -> dict[str, Any]:
    """Loss change and needle accuracy with the first k KV heads of `order` windowed, and of random orders. With
    `stop_below` (a loss bound), a random order stops at its first k that the budget's rule refuses (needle accuracy
    below the unablated model's, or loss change over the bound) where probe's order is accepted: it is clearly
    below there, and its later points (None) are not measured, except those another order already measured."""
    cache: dict[frozenset[tuple[int, int]], tuple[float, float]] = {}
    orders = {"probe": order} | {f"random_{seed}": random.Random(seed).sample(order, len(order)) for seed in seeds}
    base_loss, base_accuracy = _point(loaded, inputs, [], cache)
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
                loss, accuracy = _point(loaded, inputs, ordering[:k], cache)
                losses.append(round(loss - base_loss, 6))
                accuracies.append(round(accuracy, 6))
            done += 1
            if progress is not None:
                progress(done, total)
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
    refused = not _accepts({"loss_change": loss, "needle_accuracy": accuracy}, baseline_accuracy, max_loss_increase)
    kept = {"loss_change": ours["loss_change"][index], "needle_accuracy": ours["needle_accuracy"][index]}
    return refused and _accepts(kept, baseline_accuracy, max_loss_increase)


@dataclass
class Budget:
    """How many KV heads stream, and why: the rule, and every point the search measured (k heads streamed in the
    order: the loss change and the needle accuracy), none it did not."""

    rule: str
    streamed: int
    total: int
    points: list[dict[str, Any]] = field(default_factory=list)
    measured_on: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"  # what the model ran in: docs/precision.md says how far a half-precision run lies

    def to_dict(self) -> dict[str, Any]:
        return {"rule": self.rule, "streamed": self.streamed, "total": self.total, "points": self.points,
                "measured_on": self.measured_on, "dtype": self.dtype}

    def to_frame(self) -> Any:
        """A pandas DataFrame, one row per point the search measured (k, loss change, needle accuracy, accepted): the
        kv-budget schema's columns. Needs pandas."""
        return frame([{key: point[key] for key in ("k", "loss_change", "needle_accuracy", "accepted")}
                      for point in self.points])


def _accepts(point: dict[str, Any], baseline_accuracy: float, max_loss_increase: float) -> bool:
    return point["needle_accuracy"] >= baseline_accuracy and point["loss_change"] <= max_loss_increase


def calibrate_budget(loaded: LoadedModel, order: list[tuple[int, int]], inputs: _CurveInputs, *,
                     max_loss_increase: float = DEFAULT_MAX_LOSS_INCREASE,
                     progress: Progress | None = None) -> Budget:
    """The largest k whose point (the first k KV heads of `order` streamed) keeps the needle accuracy at the
    unablated model's and the loss change within `max_loss_increase`, by bisection over k (see the module
    docstring); every point measured is in the result."""
    cache: dict[frozenset[tuple[int, int]], tuple[float, float]] = {}
    base_loss, base_accuracy = _point(loaded, inputs, [], cache)
    points: list[dict[str, Any]] = []

    def measure(k: int) -> bool:
        loss, accuracy = _point(loaded, inputs, order[:k], cache)
        point = {"k": k, "loss_change": round(loss - base_loss, 6), "needle_accuracy": round(accuracy, 6)}
        point["accepted"] = _accepts(point, base_accuracy, max_loss_increase)
        points.append(point)
        if progress is not None:
            progress(len(points), budget_points(len(order)))
        return bool(point["accepted"])

    low, high = 0, len(order) + 1  # k = low is accepted (nothing streamed), k = high is not (past the end)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if measure(middle) else (low, middle)
    rule = (f"calibrated: the largest k whose measured point keeps needle accuracy >= {base_accuracy:.2f} (the "
            f"unablated model's) and the loss change <= +{max_loss_increase:g}, by bisection over the order")
    return Budget(rule, low, len(order), sorted(points, key=lambda point: point["k"]),
                  {"baseline_loss": round(base_loss, 6), "baseline_needle_accuracy": round(base_accuracy, 6),
                   "natural_texts": int(inputs.texts.shape[0]), "natural_length": int(inputs.texts.shape[1]),
                   "needle_prompts": int(inputs.needles.input_ids.shape[0])}, model_dtype(loaded))


def budget_points(n_kv_total: int) -> int:
    """The most points the budget's bisection measures: one per halving of k = 1 .. all."""
    return max(n_kv_total, 1).bit_length()


@dataclass
class KVHeads:
    """Retrieval and streaming scores per query head and per KV head, labels, the streaming order and its check."""

    model: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    sink: int
    recent: int
    retrieval: Tensor  # (n_layers, n_heads)
    streaming: Tensor  # (n_layers, n_heads)
    kv_retrieval: Tensor  # (n_layers, n_kv_heads): max over the group
    kv_streaming: Tensor  # (n_layers, n_kv_heads): min over the group
    order: list[tuple[int, int]]
    full: set[tuple[int, int]]
    accuracy: list[dict[str, Any]]  # the model's own needle accuracy per (length, depth), on the scored prompts
    curve: dict[str, Any] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    budget: Budget | None = None
    seconds: dict[str, float] = field(default_factory=dict)  # wall time per stage: scores, order, budget, curve
    dtype: str = "float32"  # what the model ran in: docs/precision.md says how far a half-precision run lies

    def label(self, layer: int, kv_head: int) -> str:
        return "full" if (layer, kv_head) in self.full else "streaming"

    def duo_values(self) -> list[list[float]]:
        """DuoAttention's full_attention_heads (n_layers x n_kv_heads, in [0, 1], full where > 0.5): the order's
        rank spread over (0, 0.5) for streaming heads and (0.5, 1] for full ones, so that DuoAttention's own
        `sparsify_attention_heads(sparsity=...)`, which keeps the largest values, follows probe's order too."""
        streamed = [h for h in self.order if h not in self.full]
        kept = [h for h in self.order if h in self.full]
        value = {h: 0.5 * (rank + 1) / (len(streamed) + 1) for rank, h in enumerate(streamed)}
        value |= {h: 0.5 + 0.5 * (rank + 1) / len(kept) for rank, h in enumerate(kept)}
        return [[round(value[(layer, kv)], 6) for kv in range(self.n_kv_heads)] for layer in range(self.n_layers)]

    def to_dict(self) -> dict[str, Any]:
        group = self.n_heads // self.n_kv_heads
        return {
            "model": self.model, "n_layers": self.n_layers, "n_heads": self.n_heads, "n_kv_heads": self.n_kv_heads,
            "sink": self.sink, "recent": self.recent, "options": self.options, "dtype": self.dtype,
            "aggregation": "a KV head's retrieval score is the max over its query heads, its streaming score the min",
            "kv_heads": [
                {"layer": layer, "kv_head": kv, "label": self.label(layer, kv),
                 "retrieval": round(float(self.kv_retrieval[layer, kv]), 6),
                 "streaming": round(float(self.kv_streaming[layer, kv]), 6),
                 "rank": self.order.index((layer, kv)), "query_heads": list(range(kv * group, (kv + 1) * group))}
                for layer in range(self.n_layers) for kv in range(self.n_kv_heads)],
            "heads": [{"layer": layer, "head": head, "kv_head": head // group,
                       "retrieval": round(float(self.retrieval[layer, head]), 6),
                       "streaming": round(float(self.streaming[layer, head]), 6)}
                      for layer in range(self.n_layers) for head in range(self.n_heads)],
            "order": [list(h) for h in self.order],
            "n_streaming": self.n_layers * self.n_kv_heads - len(self.full),
            "needle_accuracy": self.accuracy,
            "curve": self.curve,
            "budget": None if self.budget is None else self.budget.to_dict(),
            "duo_full_attention_heads": self.duo_values(),
            "seconds": self.seconds,
        }

    def to_frame(self) -> Any:
        """A pandas DataFrame, one row per query head: layer, head, name, its KV head, retrieval and streaming
        scores, and its KV head's label and rank in the streaming order (the kv-heads schema's columns). Needs
        pandas."""
        rows = head_rows(self.to_dict()["heads"], ("kv_head", "retrieval", "streaming"))
        for row in rows:
            row["label"] = self.label(row["layer"], row["kv_head"])
            row["rank"] = self.order.index((row["layer"], row["kv_head"]))
        return frame(rows)

    def _repr_html_(self) -> str:
        from probe.reports.kv_heads import kv_heads_page  # reports render; the library never needs them otherwise

        return kv_heads_page(self.to_dict(), embed_plotly=False)


def accuracy_table(needles: NeedleSet, run: NeedleRun) -> list[dict[str, Any]]:
    """The model's needle accuracy per (length, depth): all key tokens right, and the fraction of key tokens."""
    cells: dict[tuple[int, float], list[int]] = {}
    for index, cell in enumerate(needles.cells):
        cells.setdefault(cell, []).append(index)
    return [{"length": length, "depth": depth, "prompts": len(rows),
             "accuracy": round(sum(run.exact[i] for i in rows) / len(rows), 6),
             "token_accuracy": round(sum(run.token_accuracy[i] for i in rows) / len(rows), 6)}
            for (length, depth), rows in cells.items()]


def _check(loaded: LoadedModel, lengths: tuple[int, ...], sink: int, recent: int, seeds: list[int],
           order_by: str) -> None:
    if order_by not in ORDERS:
        raise ProbeError(f"order_by {order_by!r}: use one of {', '.join(ORDERS)}", parameter="order_by")
    if is_encoder_decoder(loaded.model):  # every layer would be windowed, and only decoder self-attention can be
        raise ProbeError("kv-heads sorts a decoder-only model's KV heads for a decoding cache; an encoder-decoder's "
                         "encoder and cross-attention keep no such cache: it is not supported")
    if sink < 0 or recent < 1:
        raise ProbeError(f"sink must be >= 0 and recent >= 1, got sink {sink}, recent {recent}", parameter="recent")
    if not lengths or max(lengths) <= sink + recent + 16:
        raise ProbeError(f"the streaming score reads queries past sink + recent = {sink + recent}: give lengths "
                         f"longer than {sink + recent + 16} or a smaller recent", parameter="lengths")
    if len(set(seeds)) != len(seeds):
        raise ProbeError("random_seeds must differ from each other", parameter="random_seeds")


def _held_out(loaded: LoadedModel, options: NeedleOptions, data: str | None, texts: int, first_text: int,
              seed_offset: int, window: WindowAblation) -> _CurveInputs:
    """Inputs the scores never read: natural texts `first_text` .. `first_text + texts` of the longest length and
    needle prompts of seed `options.seed + seed_offset`."""
    needles = needle_set(loaded, replace(options, seed=options.seed + seed_offset))
    n_heads, n_kv = kv_groups(loaded)
    return _CurveInputs(_texts(loaded, options, data, texts, first_text).input_ids, needles, n_heads // n_kv, window)


def _texts(loaded: LoadedModel, options: NeedleOptions, data: str | None, texts: int, first_text: int) -> ProbeSet:
    """Natural texts `first_text` .. `first_text + texts` of the longest length: the curve reads the first ones, the
    budget the next, the loss order the ones after."""
    natural = natural_set(loaded, data=data, seq_len=max(options.lengths) - 1, num_seqs=first_text + texts,
                          seed=options.seed)
    if natural.input_ids.shape[0] < first_text + texts:
        raise ProbeError(f"the text has {natural.input_ids.shape[0]} sequences of {max(options.lengths)} tokens; the "
                         f"curve, the budget and the order need {first_text + texts} different ones: give a longer "
                         "--data or fewer curve texts", parameter="curve_texts")
    return ProbeSet(natural.name, f"{natural.description}, sequences {first_text}..{first_text + texts - 1}",
                    natural.input_ids[first_text:first_text + texts], natural.offset)


def _fixed_budget(order: list[tuple[int, int]], kv_retrieval: Tensor, kv_streaming: Tensor, full_fraction: float | None,
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


def kv_heads(
    loaded: LoadedModel, *, lengths: tuple[int, ...] = (1024,), depths: tuple[float, ...] = DEFAULT_DEPTHS,
    prompts: int = 1, needle: str | None = None, sink: int = KV_SINK, recent: int = DEFAULT_RECENT,
    full_fraction: float | None = None, retrieval_threshold: float | None = None,
    streaming_threshold: float | None = None, max_loss_increase: float = DEFAULT_MAX_LOSS_INCREASE,
    curve: bool = True, steps: int = 5, random_seeds: tuple[int, ...] = (0, 1), curve_texts: int = 2,
    data: str | None = None, seed: int = 0, order_by: str = "retrieval", stop_random: bool = True,
    progress: Progress | None = None,
) -> KVHeads:
    """Score every head for retrieval (needle prompts of `lengths` x `depths`, `prompts` each) and streaming (sink +
    `recent` window), aggregate per KV head, order them, label full / streaming (a calibrated budget unless
    `full_fraction` or a threshold is given: see the module docstring), and (with `curve`) check the order: windowed
    KV heads k = 0 .. all in `steps` steps, loss on `curve_texts` natural texts of the longest length and accuracy on
    needle prompts of another seed, against random orders of `random_seeds` (`stop_random`: each stops once clearly
    below probe's order, see stream_curve). `order_by`: a name of ORDERS."""
    _check(loaded, tuple(lengths), sink, recent, list(random_seeds), order_by)
    options = NeedleOptions(seed=seed, lengths=tuple(lengths), depths=tuple(depths), prompts=prompts,
                            **({"needle": needle} if needle else {}))  # type: ignore[arg-type]
    calibrated, why_fixed = _budget_kind(loaded, full_fraction is None and retrieval_threshold is None
                                         and streaming_threshold is None)
    scored = needle_set(loaded, options)
    n_heads, n_kv = kv_groups(loaded)
    n_total = len(attention_layers(loaded.model)) * n_kv
    counts = [scored.input_ids.shape[0], n_total if order_by == "loss" else 0,
              budget_points(n_total) if calibrated else 0,
              (len(curve_steps(n_total, steps)) + 1) * (1 + len(random_seeds)) if curve else 0]
    stage, clock = _stages(progress, counts), _Clock()
    retrieval, streaming, run = score_needles(loaded, scored, sink=sink, recent=recent, progress=stage(0))
    clock.lap("scores")
    kv_retrieval, kv_streaming = aggregate(retrieval, n_kv, "max"), aggregate(streaming, n_kv, "min")
    window = WindowAblation(sink=sink, recent=recent)
    order = stream_order(kv_retrieval, kv_streaming) if order_by == "retrieval" else loss_order(
        loaded, kv_retrieval, _texts(loaded, options, data, curve_texts, 2 * curve_texts), window, progress=stage(1))[0]
    clock.lap("order")
    if calibrated:
        held_out = _held_out(loaded, options, data, curve_texts, curve_texts, BUDGET_SEED_OFFSET, window)
        budget = calibrate_budget(loaded, order, held_out, max_loss_increase=max_loss_increase, progress=stage(2))
        budget.measured_on["needle_seed"] = seed + BUDGET_SEED_OFFSET
        full = set(order[budget.streamed:])
    else:
        budget, full = _fixed_budget(order, kv_retrieval, kv_streaming, full_fraction,
                                     (retrieval_threshold, streaming_threshold), model_dtype(loaded), why_fixed)
    clock.lap("budget")
    result = KVHeads(loaded.name, retrieval.shape[0], n_heads, n_kv, sink, recent, retrieval.float(),
                     streaming.float(), kv_retrieval.float(), kv_streaming.float(), order, full,
                     accuracy_table(scored, run), budget=budget, dtype=model_dtype(loaded))
    result.options = {"lengths": list(lengths), "depths": list(depths), "prompts": prompts, "seed": seed,
                      "needle": options.needle, "full_fraction": full_fraction,
                      "retrieval_threshold": retrieval_threshold, "streaming_threshold": streaming_threshold,
                      "max_loss_increase": max_loss_increase, "order_by": order_by, "stop_random": stop_random,
                      "scored_on": scored.description}
    if curve:
        inputs = _held_out(loaded, options, data, curve_texts, 0, CURVE_SEED_OFFSET, window)
        ks = sorted(set(curve_steps(len(order), steps)) | {budget.streamed})  # the map's own k, checked too
        result.curve = stream_curve(loaded, order, inputs, ks, list(random_seeds), stage(3),
                                    stop_below=max_loss_increase if stop_random else None)
        result.curve["needle_seed"] = seed + CURVE_SEED_OFFSET
        clock.lap("curve")
    result.seconds = clock.laps
    return result


class _Clock:
    """Wall seconds per stage, in the order the stages ran."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self.last = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.laps[stage] = round(now - self.last, 3)
        self.last = now


def _budget_kind(loaded: LoadedModel, wanted: bool) -> tuple[bool, str | None]:
    """(whether the budget is calibrated, why not where it was wanted but cannot be)."""
    if not wanted or all(layer.kind == "hf" for layer in attention_layers(loaded.model)):
        return wanted, None
    return False, ("a calibrated budget measures window ablation, which needs transformers attention; this model's "
                   "is its own")


def _stages(progress: Progress | None, counts: list[int]) -> Callable[[int], Progress | None]:
    """Progress callbacks for consecutive stages of `counts` steps each, reported as one bar over their sum."""
    total = sum(counts)

    def stage(index: int) -> Progress | None:
        if progress is None:
            return None
        before = sum(counts[:index])
        return lambda done, _: progress(before + min(done, counts[index]), total)
    return stage

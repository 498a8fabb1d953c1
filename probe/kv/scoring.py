"""The scoring pass of `kv_heads` (one forward per needle prompt, sums fetched once after it), and needle accuracy."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from probe.hooks.layers import attention_layers
from probe.hooks.run import logits_of, run_model
from probe.inputs import NeedleSet
from probe.overflow import overflowed
from probe.accel.classes import streaming_from_lse
from probe.heads.scores import (DEFAULT_RECENT, DEFAULT_SINK, NeedleBatch, retrieval_hits, retrieval_rows,
                                streaming_score)
from probe.hooks.capture import attention_hooks
from probe.hooks.types import Handler, HookContext
from probe.kernels import FusedStatistics
from probe.kernels.fused import Weights, uploaded
from probe.models import LoadedModel
from probe.progress import ProgressArg, callback, reports


@dataclass
class NeedleRun:
    """Per needle prompt: whether and how much of the key the model predicted, teacher-forced."""

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
    ids, mask = needles.rows(first, batch_size)
    return ids, mask, needles.sources[first:first + batch_size, :ids.shape[1]]


class _Scorer:
    """Per-layer streaming sums and each answer row's top key, on the device during one forward."""

    def __init__(self, sink: int, recent: int) -> None:
        self.streaming = partial(streaming_score, sink=sink, recent=recent)
        self.streaming_fast = partial(streaming_from_lse, sink=sink, recent=recent)
        self.paths: dict[int, str] = {}  # layers whose weights went the blocked way, and why
        self.stream_sums: dict[int, Tensor] = {}
        self.stream_counts: dict[int, Tensor] = {}
        self.tops: dict[int, list[Tensor]] = {}  # (b, h, answer rows) each row's most-attended key, per part
        self.batch: NeedleBatch | None = None
        self.rows = torch.empty(0, dtype=torch.long)

    def _stream(self, layer: int, sums: Tensor, counts: Tensor) -> None:
        if layer in self.stream_sums:
            sums = self.stream_sums[layer] + sums.to(self.stream_sums[layer].device)
            counts = self.stream_counts[layer] + counts.to(self.stream_counts[layer].device)
        self.stream_sums[layer], self.stream_counts[layer] = sums, counts

    def on_lse(self, attention: FusedStatistics, ctx: HookContext) -> None:
        """The fast path (the `lse` point): the streaming band and the answer rows' top keys from the log-sum-exp."""
        layer, batch, weights = ctx.layer, self.batch, Weights(attention)
        assert batch is not None
        self._stream(layer, *self.streaming_fast(weights, batch))
        if len(self.rows):  # (b, h, answer rows): the kernel's top keys, or argmax of the rows computed whole
            device = attention.lse.device
            rows = batch.memo(("answer rows", str(device)), lambda: uploaded(self.rows, device))  # once per prompt
            self.tops.setdefault(layer, []).append(weights.row_tops(rows))

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


@reports("scoring heads")
def score_needles(loaded: LoadedModel, needles: NeedleSet, *, sink: int = DEFAULT_SINK,
                  recent: int = DEFAULT_RECENT, progress: ProgressArg = None,
                  fast: bool = True) -> tuple[Tensor, Tensor, NeedleRun]:
    """(retrieval, streaming (n_layers, n_heads), needle accuracy), one forward per prompt with nothing read back
    inside it (`fast`: fused statistics where a layer allows). Progress in needle prompts."""
    layers, report = attention_layers(loaded.model), callback(progress)
    n_layers, n_heads = len(layers), max(layer.n_heads for layer in layers)
    retrieval_sum, retrieval_prompts = torch.zeros(n_layers, n_heads, dtype=torch.float64), 0
    stream_sum = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    stream_count = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    exact, tokens = [], []
    total, finite = needles.input_ids.shape[0], []
    for index in range(total):
        ids, mask, sources = _rows(needles, index, 1)
        scorer = _Scorer(sink, recent)
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
        if report is not None:
            report(index + 1, total)
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
    """One prompt's retrieval scores from each answer row's top key; None where no key token was copied."""
    selected = retrieval_rows(sources, correct)  # (b, rows)
    if not bool(selected.any()):
        return None
    out = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    for layer, top in tops.items():
        out[layer, :top.shape[1]] = retrieval_hits(top.transpose(1, 2)[selected], sources[selected]) / selected.sum()
    return out


def accuracy_table(needles: NeedleSet, run: NeedleRun) -> list[dict[str, Any]]:
    """The model's needle accuracy per (length, depth): all key tokens right, and the fraction of key tokens."""
    cells: dict[tuple[int, float], list[int]] = {}
    for index, cell in enumerate(needles.cells):
        cells.setdefault(cell, []).append(index)
    return [{"length": length, "depth": depth, "prompts": len(rows),
             "accuracy": round(sum(run.exact[i] for i in rows) / len(rows), 6),
             "token_accuracy": round(sum(run.token_accuracy[i] for i in rows) / len(rows), 6)}
            for (length, depth), rows in cells.items()]

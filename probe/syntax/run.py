"""Scoring every head on parsed sentences: words aligned to tokens, one forward per batch, tallies per relation."""

from __future__ import annotations

from typing import Any

import torch

from probe.inputs import context_length, is_encoder, right_padded
from probe.errors import ProbeError
from probe.hooks.capture import capture_attention
from probe.hooks.hf import is_hf_model
from probe.hooks.layers import attention_layers
from probe.hooks.run import accepts_argument
from probe.hooks.stacks import is_encoder_decoder
from probe.models import LoadedModel
from probe.progress import ProgressArg, callback, reports
from probe.provenance import model_dtype
from probe.syntax.conllu import Sentence
from probe.syntax.result import SyntaxResult
from probe.syntax.scores import CONFIDENT, MARGIN, MIN_COUNT, SCHEMES, TO_HEAD, Aligned, SyntaxTally, align, queries

EXAMPLES = 8  # sentences whose arcs the HTML report draws


def prepare(loaded: LoadedModel, sentences: list[Sentence]) -> tuple[list[Aligned], list[str]]:
    """The sentences aligned to tokens, and one line for each left out (longer than the model's context)."""
    limit, encoder = context_length(loaded), is_encoder(loaded)
    kept, skipped = [], []
    for sentence in sentences:
        aligned = align(loaded.tokenizer, sentence, encoder)
        if limit is not None and len(aligned.ids) > limit:
            skipped.append(f"{sentence.where}: {len(aligned.ids)} tokens, longer than the model's context of "
                           f"{limit}: skipped")
            continue
        kept.append(aligned)
    if not kept:
        raise ProbeError("no sentence fits the model's context" if sentences else "no sentences to score")
    return kept, skipped


def _example(aligned: Aligned, predicted: torch.Tensor | None, causal: bool) -> dict[str, Any]:
    """What the HTML draws of one sentence: its words, its scored arcs, and per head the arcs it gets right."""
    scored = queries(aligned, causal)
    keep = [i for i, (_, _, _, direction) in enumerate(scored) if causal or direction == TO_HEAD]
    arcs = [{"query": scored[i][0], "target": scored[i][1], "relation": scored[i][2], "direction": scored[i][3]}
            for i in keep]
    hits: list[list[int]] = []
    if predicted is not None:
        targets = torch.tensor([scored[i][1] for i in keep])
        right = predicted[:, :, keep] == targets  # (layers, heads, arcs)
        hits = [row.nonzero().flatten().tolist() for row in right.flatten(0, 1)]
    return {"where": aligned.sentence.where, "words": aligned.sentence.words, "arcs": arcs, "hits": hits}


def _check(*, batch_size: int, min_count: int, margin: float, confident: float) -> None:
    for name, value, low in (("batch_size", batch_size, 1), ("min_count", min_count, 1)):
        if value < low:
            raise ProbeError(f"{name} must be at least {low}, got {value}", parameter=name)
    for name, fraction in (("margin", margin), ("confident", confident)):
        if not 0 <= fraction < 1:
            raise ProbeError(f"{name} must be a number from 0 to below 1, got {fraction}", parameter=name)


@reports("scoring sentences")
def syntax_scores(loaded: LoadedModel, sentences: list[Sentence], *, scheme: str, source: str,
                  batch_size: int = 8, min_count: int = MIN_COUNT, margin: float = MARGIN,
                  confident: float = CONFIDENT, examples: int = EXAMPLES,
                  progress: ProgressArg = None) -> SyntaxResult:
    """Score every head on the sentences' arcs (probe.syntax.scores' definitions); progress in sentences."""
    if scheme not in SCHEMES:
        raise ProbeError(f"unknown label scheme {scheme!r}: choose from {', '.join(SCHEMES)}", parameter="scheme")
    _check(batch_size=batch_size, min_count=min_count, margin=margin, confident=confident)
    if is_encoder_decoder(loaded.model):  # the causal variant would be applied to the encoder's layers too
        raise ProbeError("probe syntax scores one stack of layers, causal or not; an encoder-decoder has a "
                         "bidirectional encoder, a causal decoder and cross-attention: it is not supported yet")
    aligned, skipped = prepare(loaded, sentences)
    layers = attention_layers(loaded.model)
    causal = not is_encoder(loaded)
    tally = SyntaxTally(len(layers), max(layer.n_heads for layer in layers), causal, confident)
    pad = getattr(loaded.tokenizer, "pad_token_id", None)
    if not (is_hf_model(loaded.model) or accepts_argument(loaded.model, "attention_mask")):
        batch_size = 1  # a custom model that takes no mask cannot be given padding: one sentence per forward
    shown: list[dict[str, Any]] = []
    report = callback(progress)
    if report is not None:
        report(0, len(aligned))  # the count is known before the first batch, however long it runs
    for first in range(0, len(aligned), batch_size):
        batch = aligned[first:first + batch_size]
        ids, mask = right_padded([item.ids for item in batch], pad if isinstance(pad, int) else 0)
        # {layer: (batch, heads, tokens, tokens)}; no mask where nothing is padding
        captured = capture_attention(loaded.model, ids, None if bool(mask.all()) else mask)
        weights = torch.stack([captured[layer.index] for layer in layers], dim=1)  # (batch, layers, heads, t, t)
        for row, item in enumerate(batch):
            n = len(item.ids)
            predicted = tally.add(item, weights[row, :, :, :n, :n])
            if len(shown) < examples:
                shown.append(_example(item, predicted, causal))
        if report is not None:
            report(min(first + batch_size, len(aligned)), len(aligned))
    return SyntaxResult(
        model=loaded.name, scheme=scheme, source=source, causal=causal, n_layers=tally.shape[0],
        n_heads=tally.shape[1], sentences=len(aligned), words=sum(len(a.members) for a in aligned),
        relations=tally.relations, confident_share=tally.confident_share(), confident=confident,
        min_count=min_count, margin=margin, skipped=skipped, examples=shown, dtype=model_dtype(loaded))

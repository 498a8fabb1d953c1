"""One point of the streaming order: text loss and needle accuracy with k KV heads windowed, on held-out inputs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from probe.ablation.methods import ablated
from probe.ablation.window import WindowAblation
from probe.hooks.run import logits_of, run_model
from probe.inputs import NeedleSet
from probe.models import LoadedModel
from probe.kv.order import query_heads
from probe.kv.scoring import needle_accuracy


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

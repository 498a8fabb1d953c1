"""What is measured. Each metric turns a (stacked) forward's outputs into per-copy float64 sums over the positions
that count, for the whole probe set and each of its parts; `losses` finishes sums into mean losses.

- "cross_entropy" (causal LMs): mean next-token cross-entropy over all predicted tokens of the probe set (every
  position but the first predicts the next token; padding excluded), token-weighted. On the repeated set it is also
  reported on the first and on the second copy (the second is where induction heads pay off).
- "cosine_distance" (models without an LM head or not causal, e.g. BERT loaded with AutoModel): mean over
  positions of 1 - cosine similarity between the final output vectors (last hidden states, or the logits of an MLM
  head) with the head ablated and those of the unablated model. The baseline is 0 by definition.
- "task_margin" (task sets, probe.tasks): minus the mean log-probability margin of the good over the bad member of
  each pair, log P(good) - log P(bad) (BLiMP's minimal pairs, Warstadt et al. 2020; Marvin & Linzen 2018); for a
  prompt with an answer and a distractor the pair differs in its last token, so the margin is logit(answer) -
  logit(distractor) at the last prompt position (Wang et al. 2022's logit difference). Accuracy: the share of pairs
  with a positive margin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from probe.ablation.logits import Final
from probe.data import ProbeSet, is_encoder, real_tokens
from probe.errors import ProbeError
from probe.models import LoadedModel


class Metric:
    """Per-position values of one copy's outputs; `shift` 1 where position t is scored on token t + 1."""

    name: ClassVar[str]
    description: ClassVar[str]
    shift: ClassVar[int]
    compares: ClassVar[bool] = False  # compares to the unablated outputs (kept per batch; the baseline is 0)

    def values(self, output: Tensor, ids: Tensor, baseline: Tensor | None) -> Tensor:
        """(batch, positions - shift) values of one copy; output (batch, positions, features)."""
        raise NotImplementedError

    def finish(self, rows: Tensor) -> tuple[float, dict[str, float]] | None:
        """(loss, figures) from (rows,) per-sequence sums, for metrics that are not a mean over positions (None:
        the loss is the sums over the counts)."""
        return None

    def signs(self, rows: int) -> Tensor | None:
        """(rows,) +1 where a higher value of a sequence is worse, -1 where it is better (None: +1 everywhere)."""
        return None

    def __str__(self) -> str:
        return self.description


class CrossEntropy(Metric):
    name = "cross_entropy"
    description = "mean next-token cross-entropy over all predicted tokens (padding excluded)"
    shift = 1

    def values(self, output: Tensor, ids: Tensor, baseline: Tensor | None) -> Tensor:
        logits = output[:, :-1].float()  # (batch, positions - 1, vocab)
        targets = ids[:, 1:].to(output.device)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               reduction="none").view(targets.shape)


class CosineDistance(Metric):
    name = "cosine_distance"
    description = ("mean over positions of 1 - cosine similarity of the final outputs (last hidden states, or "
                   "logits) to the unablated model's")
    shift = 0
    compares = True

    def values(self, output: Tensor, ids: Tensor, baseline: Tensor | None) -> Tensor:
        assert baseline is not None
        return 1.0 - F.cosine_similarity(output.float(), baseline.to(output.device).float(), dim=-1)


class TaskMargin(CrossEntropy):
    """Rows of a task set come in pairs (good, bad), each scored on its sentence's tokens or its answer token."""

    name = "task_margin"
    description = ("minus the mean margin log P(good) - log P(bad) over the task's pairs (prompts: logit(answer) - "
                   "logit(distractor) at the last prompt position); delta > 0: the ablation hurts the task")

    def signs(self, rows: int) -> Tensor | None:
        return torch.tensor([1.0, -1.0]).repeat(rows // 2)  # good rows: loss up hurts; bad rows: loss up helps

    def finish(self, rows: Tensor) -> tuple[float, dict[str, float]] | None:
        margins = rows[1::2] - rows[0::2]  # cross-entropy sums: bad - good = log P(good) - log P(bad)
        return -float(margins.mean()), {"margin": float(margins.mean()), "accuracy": float((margins > 0).double().mean())}


METRICS: dict[str, Metric] = {metric.name: metric for metric in (CrossEntropy(), CosineDistance(), TaskMargin())}
"""Metrics by name; a new metric is one class here (and where it applies, `metric_for`)."""


def metric_named(name: str) -> Metric:
    if name not in METRICS:
        raise ProbeError(f"unknown metric {name!r}: use one of {', '.join(METRICS)}", parameter="metric")
    return METRICS[name]


def metric_for(loaded: LoadedModel, output: Any) -> str:
    """Next-token loss where it makes sense (a causal model with logits over the vocabulary), else cosine distance."""
    if is_encoder(loaded):
        return "cosine_distance"
    if isinstance(output, Tensor):
        causal = output.shape[-1] == loaded.vocab_size
    else:
        causal = isinstance(getattr(output, "logits", None), Tensor) or (
            isinstance(output, (tuple, list)) and isinstance(output[0], Tensor)
            and output[0].shape[-1] == loaded.vocab_size)
    return "cross_entropy" if causal else "cosine_distance"


def parts_of(probe_set: ProbeSet) -> dict[str, tuple[int, int]]:
    """name -> [start, stop) of the positions predicted / compared: the two copies of a repeated set."""
    if probe_set.repeat_len is None:
        return {}
    start, length = probe_set.offset, probe_set.repeat_len
    return {"first_repeat": (start, start + length), "second_repeat": (start + length, start + 2 * length)}


def losses(sums: Tensor, counts: Tensor, names: list[str]) -> tuple[float, dict[str, float]]:
    """(loss over the whole set, loss of each part) from (parts + 1,) sums and counts."""
    values = [float(sums[i] / counts[i].clamp(min=1)) for i in range(len(names) + 1)]
    return values[0], dict(zip(names, values[1:]))


@dataclass
class Scorer:
    """A metric over one probe set: which positions count, and the sums of a forward's outputs over them."""

    metric: Metric
    parts: dict[str, tuple[int, int]]  # name -> [start, stop) of the positions predicted / compared
    keep: list[Tensor] | None = None  # when a list: every `sums` call appends its (copies, batch, positions') values

    def masks(self, ids: Tensor, mask: Tensor | None, scored: Tensor | None = None) -> Tensor:
        """(parts + 1, batch, positions - shift) booleans: which positions count, for the whole set and each part;
        `scored` (batch, positions - shift): only these (a task set's sentence or answer tokens)."""
        valid = real_tokens(ids, mask)
        if self.metric.shift:  # position t predicts token t + 1; both must be real tokens
            valid = valid[:, :-1] & valid[:, 1:]
            positions = torch.arange(1, ids.shape[1])  # the predicted token's position
        else:
            positions = torch.arange(ids.shape[1])
        if scored is not None:
            valid = valid & scored[:, :valid.shape[1]]
        rows = [valid]
        for start, stop in self.parts.values():
            rows.append(valid & ((positions >= start) & (positions < stop))[None, :])
        return torch.stack(rows)

    def sums(self, output: Tensor | Final, ids: Tensor, masks: Tensor, copies: int,
             baseline: Tensor | None = None) -> Tensor:
        """(copies, parts + 1) float64 sums of the metric over the positions that count."""
        batch = ids.shape[0]
        if isinstance(output, Final):  # long context: the logits never exist in full
            values = output.cross_entropy().view(copies, batch, -1).cpu()
            if self.keep is not None:
                self.keep.append(values)
            return (values.double()[:, None] * masks.cpu()[None]).sum(dim=(2, 3))
        out = output.reshape(copies, batch, *output.shape[1:])  # (copies, batch, positions, features)
        masks = masks.to(output.device)
        result = torch.zeros(copies, masks.shape[0], dtype=torch.float64)
        kept = []
        for copy in range(copies):
            values = self.metric.values(out[copy], ids, baseline)
            result[copy] = (values.double()[None] * masks).sum(dim=(1, 2)).cpu()
            kept.append(values.detach().float().cpu())
        if self.keep is not None:
            self.keep.append(torch.stack(kept))
        return result

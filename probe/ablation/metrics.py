"""What is measured: a metric turns a (stacked) forward's outputs into per-copy float64 sums over the positions that
count, whole and per part. A metric (of METRICS) declares what it reads and where it applies; callers ask it."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from probe.ablation.blocks import Final
from probe.hooks.run import logits_of, run_model
from probe.inputs import CLASS_CONTRAST_LAYOUT, LABELS_LAYOUT, ProbeSet, is_encoder, read_text_file, real_tokens
from probe.errors import ProbeError
from probe.models import LoadedModel

KINDS = {"text": "a causal LM's next-token predictions on text",
         "task": "a task set's scored positions",
         "contrast": "prompts each followed by their answer and distractor (clean/corrupt pairs)",
         "outputs": "a model without next-token logits (an encoder, or no LM head)",
         "labels": "a sequence classifier's class logits on labelled texts",
         "class_contrast": "a sequence classifier's clean/corrupt text pairs, with an answer and a distractor class"}
"""The kinds of input a metric can apply to, as `input_kind` tells them apart."""

CONTRAST_LAYOUT = "prompt, answer, distractor"
"""The layout of rows of a prompt, its answer and its distractor, scored at the last prompt position (logit_diff)."""

PATCH_LAYOUTS = (CONTRAST_LAYOUT, CLASS_CONTRAST_LAYOUT)
"""The layouts of patching's runs: a language model's prompts (logit_diff), a classifier's texts (class_logit_diff)."""


class Metric:
    """Per-position values of one copy's outputs; `shift` 1 where position t is scored on token t + 1."""

    name: ClassVar[str]
    description: ClassVar[str]
    shift: ClassVar[int]
    reads: ClassVar[str] = "next-token logits"  # what of a forward it reads, for help texts
    applies: ClassVar[tuple[str, ...]] = ("text",)  # the input kinds (KINDS) it is defined on
    default_for: ClassVar[tuple[str, ...]] = ()  # the input kinds it is chosen for when none is named
    compares: ClassVar[bool] = False  # compares to the unablated outputs (kept per batch; the baseline is 0)
    chunkable: ClassVar[bool] = False  # a next-token metric (shift 1) whose `token_values` serve long inputs
    estimable: ClassVar[bool] = False  # the attribution-patching estimate's second order (the softmax's) is its own
    per_row: ClassVar[bool] = False  # one value per row (a classifier's): `values` (batch, classes), by `scored`
    surrogate: ClassVar[str | None] = None  # a metric without a gradient: the metric whose gradient stands in for it
    forwards: ClassVar[str | None] = None  # minus what it is (a margin's loss): steering shows that, "higher = more"

    def token_values(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Chunkable metrics: values from logits (..., vocab) at positions t and the tokens (...) at t + 1."""
        raise NotImplementedError

    def values(self, output: Tensor, ids: Tensor, baseline: Tensor | None) -> Tensor:
        """(batch, positions - shift) values of one copy; a chunkable metric's are its token values."""
        return self.token_values(output[:, :-1].float(), ids[:, 1:].to(output.device))

    def finish(self, rows: Tensor) -> tuple[float, dict[str, float]] | None:
        """(loss, figures) from (rows,) per-sequence sums (None: the loss is the sums over the counts)."""
        return None

    def signs(self, rows: int) -> Tensor | None:
        """(rows,) +1 where a higher value of a sequence is worse, -1 where it is better (None: +1 everywhere)."""
        return None

    def __str__(self) -> str:
        return self.description


METRICS: dict[str, Metric] = {}
"""Metrics by name; a new metric is one class registered here (`register_metric`)."""


def register_metric(metric: type[Metric]) -> type[Metric]:
    """Register (an instance of) a metric class under its name (usable as a class decorator)."""
    METRICS[metric.name] = metric()
    return metric


def _margin_loss(margins: Tensor) -> tuple[float, dict[str, float]]:
    """Minus the mean margin, and the margin and accuracy (the share of positive margins) as figures."""
    return -float(margins.mean()), {"margin": float(margins.mean()), "accuracy": float((margins > 0).double().mean())}


@register_metric
class CrossEntropy(Metric):
    name = "cross_entropy"
    description = "mean next-token cross-entropy over all predicted tokens (padding excluded)"
    shift = 1
    default_for = ("text",)
    chunkable = True
    estimable = True

    def token_values(self, logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               reduction="none").view(targets.shape)


@register_metric
class CosineDistance(Metric):
    name = "cosine_distance"
    description = ("mean over positions of 1 - cosine similarity of the final outputs (last hidden states, or "
                   "logits) to the unablated model's")
    shift = 0
    reads = "the final outputs (last hidden states, or logits)"
    applies = ("text", "outputs")
    default_for = ("outputs",)
    compares = True

    def values(self, output: Tensor, ids: Tensor, baseline: Tensor | None) -> Tensor:
        assert baseline is not None
        return 1.0 - F.cosine_similarity(output.float(), baseline.to(output.device).float(), dim=-1)


@register_metric
class TaskMargin(CrossEntropy):
    """Rows of a task set come in pairs (good, bad), each scored on its sentence's tokens or its answer token."""

    name = "task_margin"
    description = ("minus the mean margin log P(good) - log P(bad) over the task's pairs (prompts: logit(answer) - "
                   "logit(distractor) at the last prompt position); delta > 0: the ablation hurts the task")
    reads = "next-token logits at a task set's scored positions"
    applies = ("task",)
    default_for = ("task",)
    forwards = "task margin"
    estimable = False  # a difference of two sequences' losses

    def signs(self, rows: int) -> Tensor | None:
        return torch.tensor([1.0, -1.0]).repeat(rows // 2)  # good rows: loss up hurts; bad rows: loss up helps

    def finish(self, rows: Tensor) -> tuple[float, dict[str, float]] | None:
        return _margin_loss(rows[1::2] - rows[0::2])  # cross-entropy sums: bad - good = log P(good) - log P(bad)


@register_metric
class KLDivergence(Metric):
    """KL(p_unablated || p_ablated) of the next-token distributions (Conmy et al. 2023, ACDC)."""

    name = "kl"
    description = ("mean over predicted positions of KL(p_unablated || p_ablated) of the next-token distributions; "
                   "the baseline is 0")
    shift = 1
    reads = "the full next-token distributions, against the unablated model's"
    applies = ("text", "task")
    compares = True

    def values(self, output: Tensor, ids: Tensor, baseline: Tensor | None) -> Tensor:
        assert baseline is not None
        reference = baseline[:, :-1].to(output.device).float().log_softmax(-1)  # (batch, positions - 1, vocab)
        ablated = output[:, :-1].float().log_softmax(-1)
        return (reference.exp() * (reference - ablated)).sum(dim=-1)


@register_metric
class LogitDiff(Metric):
    """Minus logit(answer) - logit(distractor) at the last prompt position (Wang et al. 2022), rows CONTRAST_LAYOUT."""

    name = "logit_diff"
    description = ("minus the mean logit(answer) - logit(distractor) at the last prompt position; delta > 0: the "
                   "change lowers the logit difference")
    shift = 1
    reads = "next-token logits at the last prompt position: the answer's and the distractor's"
    applies = ("contrast",)
    default_for = ("contrast",)
    forwards = "logit difference"

    def values(self, output: Tensor, ids: Tensor, baseline: Tensor | None) -> Tensor:
        logits = output[:, :-2].float()  # (batch, positions - 2, vocab): position t, answer t + 1, distractor t + 2
        ids = ids.to(output.device)
        answer = logits.gather(-1, ids[:, 1:-1, None])[..., 0]
        distractor = logits.gather(-1, ids[:, 2:, None])[..., 0]
        return F.pad(distractor - answer, (0, 1))  # (batch, positions - 1): the last position reads nothing

    def finish(self, rows: Tensor) -> tuple[float, dict[str, float]] | None:
        return _margin_loss(-rows)  # one scored position per row: its logit difference


@register_metric
class TargetWords(Metric):
    """The next-token probability of target words' first tokens (after a space); made by `target_words`."""

    name = "target_words"
    description = ("mean over predicted positions of the next-token probability of the target words' first tokens; "
                   "higher: more of the behaviour")
    shift = 1
    reads = "next-token probabilities of the target words' first tokens"
    chunkable = True

    def __init__(self, tokens: Sequence[int] = (), words: Sequence[str] = ()) -> None:
        self.tokens, self.words = tuple(dict.fromkeys(int(token) for token in tokens)), tuple(words)
        if self.tokens:  # a stream's fingerprint names the metric: two word lists are two sweeps
            digest = hashlib.sha256(" ".join(map(str, self.tokens)).encode()).hexdigest()[:12]
            self.name = f"target_words:{digest}"  # type: ignore[misc]

    def token_values(self, logits: Tensor, targets: Tensor) -> Tensor:
        if not self.tokens:
            raise ProbeError("metric target_words measures the probability of chosen words, made from a file of one "
                             "word or phrase per line: target_words(loaded, path), or probe steer --target-words FILE",
                             parameter="metric")
        chosen = torch.tensor(self.tokens, device=logits.device)
        logits = logits.float()
        return (logits.index_select(-1, chosen) - logits.logsumexp(-1, keepdim=True)).exp().sum(-1)


def read_target_words(path: str | Path) -> list[str]:
    """The words or phrases of a target-words file: one per line, blank lines and `#` comments skipped."""
    text = read_text_file(path, parameter="target_words", what="target-words file")
    words = [line.strip() for line in text.splitlines()]
    words = [word for word in words if word and not word.startswith("#")]
    if not words:
        raise ProbeError(f"target-words file {path} has no word: give one word or phrase per line",
                         parameter="target_words")
    return words


def target_words(loaded: LoadedModel, path: str | Path) -> TargetWords:
    """The target_words metric of the words in `path` (read_target_words), each word's first token as it appears
    after a space (" time"): the token that starts it in running text."""
    words = read_target_words(path)
    tokenizer = loaded.tokenizer
    if tokenizer is None:
        raise ProbeError(f"{loaded.name} has no tokenizer to read target words with", parameter="target_words")
    unknown = getattr(tokenizer, "unk_token_id", None)
    tokens = []
    for word in words:
        ids = list(tokenizer(" " + word, add_special_tokens=False)["input_ids"])
        if not ids or ids[0] == unknown:
            raise ProbeError(f"target word {word!r} is not in {loaded.name}'s vocabulary", parameter="target_words")
        tokens.append(int(ids[0]))
    return TargetWords(tokens, words)


class ClassMetric(Metric):
    """A sequence classifier's metric: (batch, classes) values, of which the set's `scored` counts the gold class."""

    shift = 0
    applies = ("labels",)
    per_row = True


@register_metric
class ClassCrossEntropy(ClassMetric):
    """The cross-entropy of each row's gold class under a classifier's class logits: every class's -log p."""

    name = "class_cross_entropy"
    description = "mean cross-entropy of each text's gold class (a sequence classifier on labelled texts)"
    reads = "a sequence classifier's class logits and each text's gold label"
    default_for = ("labels",)

    def values(self, output: Tensor, ids: Tensor, baseline: Tensor | None) -> Tensor:
        return -output.float().log_softmax(dim=-1)  # (batch, classes)


@register_metric
class Accuracy(ClassMetric):
    """1 - accuracy: 1 for every class but the top one (argmax's first on ties), so the gold class's is the error."""

    name = "accuracy"
    description = ("1 - accuracy on labelled texts (the share whose top class is not the gold one); delta > 0: the "
                   "ablation costs accuracy")
    reads = "a sequence classifier's top class and each text's gold label"
    surrogate = "class_cross_entropy"

    def values(self, output: Tensor, ids: Tensor, baseline: Tensor | None) -> Tensor:
        top = F.one_hot(output.argmax(dim=-1), output.shape[-1])
        return (1 - top).float()  # (batch, classes)

    def finish(self, rows: Tensor) -> tuple[float, dict[str, float]] | None:
        error = float(rows.mean())
        return error, {"accuracy": 1.0 - error}


@register_metric
class ClassLogitDiff(ClassMetric):
    """Minus logit(answer) - logit(distractor) of a classifier: values -logit then +logit, of which `scored` picks."""

    name = "class_logit_diff"
    description = ("minus the mean logit(answer class) - logit(distractor class) of a classifier; delta > 0: the "
                   "change lowers the logit difference")
    reads = "a sequence classifier's class logits: the answer class's and the distractor class's"
    applies = default_for = ("class_contrast",)
    finish = LogitDiff.finish

    def values(self, output: Tensor, ids: Tensor, baseline: Tensor | None) -> Tensor:
        return torch.cat([-output.float(), output.float()], dim=-1)


@register_metric
class TopOne(Metric):
    """1 - top-1 accuracy of the next token (argmax's first on ties), an error so that delta > 0 is a cost."""

    name = "top1"
    description = ("1 - top-1 accuracy of the next token (the share of predicted positions whose most likely token "
                   "is not the next one); delta > 0: the ablation costs accuracy")
    shift = 1
    reads = "the next-token logits' most likely token"
    chunkable = True
    surrogate = "cross_entropy"  # argmax has no gradient: Michel importance differentiates the loss instead

    def token_values(self, logits: Tensor, targets: Tensor) -> Tensor:
        return (logits.argmax(dim=-1) != targets).float()


def has_logits(loaded: LoadedModel, output: Any) -> bool:
    """Whether a forward's output is next-token logits over the vocabulary (a causal LM with its head)."""
    if is_encoder(loaded):
        return False
    if isinstance(output, Tensor):
        return output.dim() == 3 and output.shape[-1] == loaded.vocab_size
    logits = getattr(output, "logits", None)
    if isinstance(logits, Tensor):
        return logits.dim() == 3  # a sequence classifier's are (batch, classes)
    return isinstance(output, (tuple, list)) and isinstance(output[0], Tensor) and output[0].dim() == 3 and \
        output[0].shape[-1] == loaded.vocab_size


def input_kind(loaded: LoadedModel, probe_set: ProbeSet) -> str:
    """Which of KINDS the model and probe set are; a classifier on anything but labelled texts is refused."""
    layout = probe_set.meta.get("layout")
    if layout in (LABELS_LAYOUT, CLASS_CONTRAST_LAYOUT):
        return "labels" if layout == LABELS_LAYOUT else "class_contrast"
    if probe_set.scored is not None:
        return "contrast" if probe_set.meta.get("layout") == CONTRAST_LAYOUT else "task"
    ids, mask = probe_set.batches(1)[0]
    with torch.no_grad():
        output = run_model(loaded.model, ids[:1, :2], None if mask is None else mask[:1, :2])
    if logits_of(output).dim() == 2:
        raise ProbeError(f"{loaded.name} is a sequence classifier (its output is class logits): measure it on "
                         "labelled texts (labels: a JSON-lines file of {\"text\", \"label\"} rows)", parameter="labels")
    return "text" if has_logits(loaded, output) else "outputs"


def choose_metric(loaded: LoadedModel, probe_set: ProbeSet, metric: str | Metric | None = None) -> Metric:
    """The metric named or given, checked against the input's kind; None: the kind's default metric."""
    kind = input_kind(loaded, probe_set)
    if metric is None:
        return next(candidate for candidate in METRICS.values() if kind in candidate.default_for)
    chosen = metric if isinstance(metric, Metric) else METRICS.get(metric)
    if chosen is None:
        raise ProbeError(f"unknown metric {metric!r}: use one of {', '.join(METRICS)}", parameter="metric")
    if kind not in chosen.applies:
        usable = [name for name, candidate in METRICS.items() if kind in candidate.applies]
        raise ProbeError(f"metric {chosen.name} applies to {' or '.join(KINDS[k] for k in chosen.applies)}, not to "
                         f"{KINDS[kind]}: use one of {', '.join(usable)}", parameter="metric")
    return chosen


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
        """(parts + 1, batch, positions - shift) booleans of the positions that count (only `scored` where given); a
        per-row metric's (parts + 1, batch, classes): `scored` itself."""
        if self.metric.per_row:
            if scored is None:
                raise ProbeError(f"metric {self.metric.name} reads labelled texts: give labels", parameter="labels")
            valid = scored.bool() & real_tokens(ids, mask).any(dim=1, keepdim=True)
            return torch.stack([valid] + [torch.zeros_like(valid)] * len(self.parts))
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
        if isinstance(output, Final):  # long context: the logits never exist in full (a chunkable metric)
            values = output.values(self.metric.token_values).view(copies, batch, -1).cpu()
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

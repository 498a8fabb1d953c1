"""Contrast sets: clean/corrupt prompt pairs of one token length, from a JSON-lines file or generated (CONTRAST_TASKS),
for DLA and patching; the metric is logit(answer) - logit(distractor) at the last prompt position (Wang et al. 2022)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from probe.hooks.run import logits_of, run_model
from probe.errors import ProbeError
from probe.overflow import forwards, require_finite
from probe.models import LoadedModel
from probe.inputs.sets import ProbeOptions, bos_ids, check_context, register_probe_set, right_padded
from probe.inputs.tasks import TaskItem, ioi_draws, json_lines, not_single_token, sva_draws, task_tokens, text_fields

CONTRAST_KEYS = ("clean", "corrupt", "answer", "distractor")
MIN_GAP = 0.05
"""Smallest |mean LD_clean - mean LD_corrupt| a normalised effect divides by: below it the ratio is mostly noise."""


@dataclass(frozen=True)
class ContrastPair:
    """One pair as text: two prompts of one token length, the answer after the clean one, and the distractor."""

    clean: str
    corrupt: str
    answer: str
    distractor: str


@dataclass
class ContrastSet:
    """Pairs as token ids, right-padded, clean and corrupt of one length per row; the difference read at `last[i]`."""

    name: str
    description: str
    clean: Tensor  # (pairs, positions) long
    corrupt: Tensor  # (pairs, positions) long
    mask: Tensor  # (pairs, positions) long, 1 = token
    answer: Tensor  # (pairs,) token id
    distractor: Tensor  # (pairs,) token id
    pairs: list[ContrastPair] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # generated items left out, and why
    # a classifier's pairs (probe.inputs.labels.read_class_pairs): answer and distractor are class indices of these
    # classes, read off the class logits; None: tokens, read at the last prompt position
    classes: list[str] | None = None

    @property
    def last(self) -> Tensor:
        """(pairs,) the last prompt position of each row."""
        return self.mask.sum(dim=1) - 1

    def __len__(self) -> int:
        return self.clean.shape[0]


def _problem(loaded: LoadedModel, pair: ContrastPair) -> str | None:
    """Why a pair cannot be used as it is for this model (None: it can)."""
    why = not_single_token(loaded, TaskItem(pair.clean, answer=pair.answer, distractor=pair.distractor))
    if why is not None:
        return f"{why} for this model; the logit difference needs single-token answers and distractors"
    clean, corrupt = len(task_tokens(loaded, pair.clean)), len(task_tokens(loaded, pair.corrupt))
    if clean != corrupt:
        return (f"clean is {clean} tokens and corrupt {corrupt}: a pair's prompts must tokenize to the same length, "
                "so that each position of one is that position of the other")
    return None


def _needs_tokenizer(loaded: LoadedModel, parameter: str) -> None:
    if loaded.tokenizer is None:
        raise ProbeError("clean/corrupt pairs need the model's tokenizer (this model has none)", parameter=parameter)


def contrast_set(loaded: LoadedModel, pairs: list[ContrastPair], name: str, description: str,
                 dropped: list[str] | None = None) -> ContrastSet:
    """The token ids of checked pairs (`_problem` is None for each), right-padded, BOS first where the model has one."""
    bos = bos_ids(loaded.tokenizer)
    clean = [bos + task_tokens(loaded, pair.clean) for pair in pairs]
    corrupt = [bos + task_tokens(loaded, pair.corrupt) for pair in pairs]
    (clean_ids, mask), (corrupt_ids, _) = right_padded(clean, 0), right_padded(corrupt, 0)
    check_context(loaded, clean_ids.shape[1])
    answer = torch.tensor([task_tokens(loaded, pair.answer)[0] for pair in pairs])
    distractor = torch.tensor([task_tokens(loaded, pair.distractor)[0] for pair in pairs])
    return ContrastSet(name, description, clean_ids, corrupt_ids, mask, answer, distractor, list(pairs),
                       list(dropped or []))


def read_contrast_pairs(loaded: LoadedModel, path: str | Path) -> ContrastSet:
    """The pairs of a JSON-lines file; a malformed, multi-token or unequal-length row refused naming FILE line N."""
    _needs_tokenizer(loaded, "pairs")
    pairs = []
    for where, row in json_lines(path, "pairs file", "give a .jsonl file of clean/corrupt/answer/distractor rows",
                                 "pairs"):
        pair = ContrastPair(*text_fields(row, where, "pairs", CONTRAST_KEYS))
        why = _problem(loaded, pair)
        if why is not None:
            raise ProbeError(f"{where}: {why}")
        pairs.append(pair)
    return contrast_set(loaded, pairs, Path(path).stem, f"pairs file {path}, {len(pairs)} pairs")


# generated pairs


def ioi_pairs(count: int, seed: int) -> list[ContrastPair]:
    """IOI pairs with the ABC corruption (Wang et al. 2022): a third name for the subject's second mention."""
    return [ContrastPair(prompt(s=subject), prompt(s=third), f" {io}", f" {subject}")
            for prompt, (io, subject, third) in ioi_draws(count, seed, 3)]


def sva_pairs(count: int, seed: int) -> list[ContrastPair]:
    """Agreement pairs: the corrupt prompt's subject (and agreeing clause verb) in the other number."""
    return [ContrastPair(draw.prompt(draw.plural), draw.prompt(not draw.plural), draw.verb[draw.plural],
                         draw.verb[not draw.plural]) for draw in sva_draws(count, seed)]


CONTRAST_TASKS: dict[str, Callable[[int, int], list[ContrastPair]]] = {"ioi": ioi_pairs, "sva": sva_pairs}
"""Generated contrast tasks by name: (number of pairs, seed) -> pairs. A new task is one function here."""


def contrast_task(loaded: LoadedModel, task: str, *, count: int = 32, seed: int = 0) -> ContrastSet:
    """A generated contrast set (of CONTRAST_TASKS); pairs this model cannot use are dropped and counted."""
    if task not in CONTRAST_TASKS:
        raise ProbeError(f"task {task!r} is not a contrast task: use one of {', '.join(CONTRAST_TASKS)}, or a pairs "
                         "file", parameter="task")
    _needs_tokenizer(loaded, "task")
    if count < 1:
        raise ProbeError(f"count must be at least 1, got {count}", parameter="count")
    kept, dropped = [], []
    for pair in CONTRAST_TASKS[task](count, seed):
        why = _problem(loaded, pair)
        if why is None:
            kept.append(pair)
        else:
            dropped.append(f"{pair.clean!r}: {why}")
    if not kept:
        raise ProbeError(f"no pair of task {task} is usable with this model ({dropped[0]})", parameter="task")
    description = f"{task}: generated, {count} pairs, seed {seed}" + (f", {len(dropped)} dropped" if dropped else "")
    return contrast_set(loaded, kept, task, description, dropped)


def contrast_inputs(loaded: LoadedModel, options: ProbeOptions) -> ContrastSet:
    """The contrast probe set: the pairs file `options.pairs`, or the generated task `options.task` (num_seqs pairs)."""
    if options.pairs is not None:
        return read_contrast_pairs(loaded, options.pairs)
    return contrast_task(loaded, str(options.task), count=options.num_seqs, seed=options.seed)


register_probe_set("contrast", contrast_inputs, kind="contrast", reads=("pairs", "task"),
                   summary="clean/corrupt pairs: a JSON-lines file of clean/corrupt/answer/distractor rows, or a "
                           "generated task (ioi, sva); the metric is the logit difference at the last position")


# the metric


def logit_diff(logits: Tensor, contrast: ContrastSet, rows: Tensor | slice | None = None) -> Tensor:
    """(pairs,) float64 logit(answer) - logit(distractor) at each pair's last prompt position (rows `rows`)."""
    chosen = slice(None) if rows is None else rows
    last, answer, distractor = (value[chosen] for value in (contrast.last, contrast.answer, contrast.distractor))
    at_last = logits[torch.arange(logits.shape[0]), last.to(logits.device)].double()  # (batch, vocab)
    index = torch.arange(at_last.shape[0])
    return (at_last[index, answer.to(at_last.device)] - at_last[index, distractor.to(at_last.device)]).cpu()


def normalised_effect(ld_patched: Tensor | float, ld_clean: Tensor | float, ld_corrupt: Tensor | float) -> float:
    """(mean LD_patched - mean LD_corrupt) / (mean LD_clean - mean LD_corrupt) (Wang et al. 2022): 1 = clean
    behaviour restored; ProbeError where the clean and corrupt means are closer than MIN_GAP."""
    patched, clean, corrupt = (float(torch.as_tensor(value, dtype=torch.float64).mean())
                               for value in (ld_patched, ld_clean, ld_corrupt))
    if abs(clean - corrupt) < MIN_GAP:
        raise ProbeError(f"the clean and corrupt logit differences are too close to normalise by (mean {clean:.4f} "
                         f"vs {corrupt:.4f}, gap under {MIN_GAP}): the corruption does not change the behaviour")
    return (patched - corrupt) / (clean - corrupt)


def logit_diffs(loaded: LoadedModel, contrast: ContrastSet, ids: Tensor, *, batch_size: int = 8) -> Tensor:
    """(pairs,) float64: the model's own logit differences on `ids`, the set's clean or corrupt prompts."""
    if batch_size < 1:
        raise ProbeError(f"batch_size must be at least 1, got {batch_size}", parameter="batch_size")
    parts = []
    with torch.no_grad():
        for start in range(0, len(contrast), batch_size):
            rows = slice(start, start + batch_size)
            logits = logits_of(run_model(loaded.model, ids[rows], contrast.mask[rows]))
            parts.append(logit_diff(logits, contrast, rows))
    diffs = torch.cat(parts)
    require_finite(diffs, "the logit difference of the prompts", loaded.model,
                   forwards(loaded.model, ids, contrast.mask, batch_size))
    return diffs


def contrast_logit_diffs(loaded: LoadedModel, contrast: ContrastSet, *, batch_size: int = 8) -> tuple[Tensor, Tensor]:
    """(clean, corrupt): each (pairs,) float64, the model's own logit differences on the two prompts of each pair."""
    return tuple(logit_diffs(loaded, contrast, ids, batch_size=batch_size)  # type: ignore[return-value]
                 for ids in (contrast.clean, contrast.corrupt))

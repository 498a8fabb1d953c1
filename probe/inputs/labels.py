"""Labelled texts for sequence classifiers, `scored` one-hot on each row's gold class, and their clean/corrupt pairs.
Limit: probe passes ids and mask only, so BERT's token_type_ids see both texts of a pair as segment A."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from probe.errors import ProbeError
from probe.models.outputs import logits_of
from probe.hooks.run import run_model
from probe.inputs.contrast import ContrastPair, ContrastSet
from probe.inputs.sets import ProbeSet, context_length, given, register_probe_set, right_padded
from probe.inputs.tasks import json_lines
from probe.models import LoadedModel

CLASS_CONTRAST_LAYOUT = "clean/corrupt texts, an answer and a distractor class"
"""The layout of a classifier's clean or corrupt run: `scored` (rows, 2 x classes), answer then distractor class."""

LABELS_LAYOUT = "labels"
"""The layout of a labelled set: its `scored` marks each row's gold class."""


@dataclass(frozen=True)
class LabelledText:
    """One row of a labels file: a text (and its pair), its label as given, and where it came from (FILE line N)."""

    text: str
    label: int | str
    text_pair: str | None = None
    where: str = ""


def _label(label: Any, where: str, key: str = "label") -> int | str:
    if isinstance(label, bool) or not isinstance(label, (int, str)):
        raise ProbeError(f"{where}: a class (\"{key}\") is an integer class index or a class name (string), got "
                         f"{json.dumps(label)}", parameter="labels")
    return label


def _row(item: Any, where: str) -> LabelledText:
    if not isinstance(item, dict) or not isinstance(item.get("text"), str) or not item["text"].strip():
        raise ProbeError(f"{where}: expected an object with a non-empty string \"text\"", parameter="labels")
    label = _label(item.get("label"), where)
    pair = item.get("text_pair")
    if pair is not None and not isinstance(pair, str):
        raise ProbeError(f"{where}: \"text_pair\" must be a string", parameter="labels")
    return LabelledText(item["text"], label, pair, where)


def read_labelled(path: str | Path) -> list[LabelledText]:
    """The rows of a JSON-lines labels file; a bad row is one error naming its line."""
    return [_row(item, where) for where, item in json_lines(path, "labels file", "give a .jsonl file of "
                                                             "{\"text\", \"label\"} rows", "labels")]


def class_count(loaded: LoadedModel, ids: Tensor, mask: Tensor | None) -> int:
    """The number of classes, from one forward of one row; a model without a classification head is refused."""
    with torch.no_grad():
        output = logits_of(run_model(loaded.model, ids[:1], None if mask is None else mask[:1]))
    if output.dim() != 2:
        raise ProbeError(f"labelled texts need a sequence classifier, whose output is class logits (batch, classes); "
                         f"{loaded.name}'s output is {tuple(output.shape)} (no classification head): load a "
                         "*ForSequenceClassification model, or a custom model whose forward returns (batch, classes)",
                         parameter="labels")
    return int(output.shape[-1])


def class_names(loaded: LoadedModel, count: int) -> list[str]:
    """The classes' names: the config's `id2label` where it names `count` classes, else their indices."""
    for owner in (getattr(loaded.model, "config", None), loaded.model):
        names = getattr(owner, "id2label", None)
        if isinstance(names, dict) and len(names) == count and {int(i) for i in names} == set(range(count)):
            by_index = {int(i): str(name) for i, name in names.items()}
            return [by_index[i] for i in range(count)]
    return [str(i) for i in range(count)]


def label_index(row: LabelledText, names: list[str], where: str) -> int:
    """A row's class index: an integer within the model's classes, or a string among their names."""
    if isinstance(row.label, int):
        if not 0 <= row.label < len(names):
            raise ProbeError(f"{where}: label {row.label} is outside the model's {len(names)} classes (0 to "
                             f"{len(names) - 1})", parameter="labels")
        return row.label
    if row.label not in names:
        raise ProbeError(f"{where}: label {row.label!r} is not one of the model's classes ({', '.join(names)}; "
                         "id2label in its config)", parameter="labels")
    return names.index(row.label)


def _encode(loaded: LoadedModel, rows: list[LabelledText]) -> list[list[int]]:
    tokenizer = loaded.tokenizer
    if tokenizer is None:
        raise ProbeError("this model has no tokenizer, so it cannot read labelled texts", parameter="labels")
    encoded = [list(tokenizer(row.text, row.text_pair)["input_ids"]) if row.text_pair is not None
               else list(tokenizer(row.text)["input_ids"]) for row in rows]
    limit, longest = context_length(loaded), max(len(ids) for ids in encoded)
    if limit is not None and longest > limit:
        where = rows[max(range(len(rows)), key=lambda i: len(encoded[i]))].where
        raise ProbeError(f"{where}: {longest} tokens, more than the model's context of {limit}: shorten it",
                         parameter="labels")
    return encoded


def _pad_id(loaded: LoadedModel) -> int:
    """The tokenizer's pad id, else the config's, else 0 (padding is masked either way)."""
    for owner in (loaded.tokenizer, getattr(loaded.model, "config", None)):
        pad = getattr(owner, "pad_token_id", None)
        if isinstance(pad, int):
            return pad
    return 0


def labelled_set(loaded: LoadedModel, rows: list[LabelledText], *, description: str = "labelled texts") -> ProbeSet:
    """A probe set of labelled texts, right-padded, its `scored` one-hot on each row's gold class."""
    if not rows:
        raise ProbeError("give at least one labelled text", parameter="labels")
    rows = [row if row.where else replace(row, where=f"row {i + 1}") for i, row in enumerate(rows)]
    ids, mask = right_padded(_encode(loaded, rows), _pad_id(loaded))
    names = class_names(loaded, class_count(loaded, ids, mask))
    gold = torch.tensor([label_index(row, names, row.where) for row in rows])
    special = set(getattr(loaded.tokenizer, "all_special_ids", []) or [])
    text = f"{description}: {len(rows)} texts{' pairs' if rows[0].text_pair is not None else ''}, " \
           f"{len(names)} classes"
    return ProbeSet("labels", text, ids, 1 if int(ids[0, 0]) in special else 0, mask,
                    scored=torch.nn.functional.one_hot(gold, len(names)).bool(),
                    meta={"layout": LABELS_LAYOUT, "source": description, "classes": names,
                          "class_counts": torch.bincount(gold, minlength=len(names)).tolist()})


def read_labelled_set(loaded: LoadedModel, path: str | Path) -> ProbeSet:
    """The labelled set of a JSON-lines file (`--labels FILE.jsonl`)."""
    return labelled_set(loaded, read_labelled(path), description=f"labels file {path}")


register_probe_set("labels", lambda loaded, options: read_labelled_set(loaded, given(options.labels)), kind="labels",
                   reads=("labels",), summary="sequence classifiers: a JSON-lines file of {\"text\", \"label\"} rows "
                   "({\"text\", \"text_pair\", \"label\"} for sentence pairs); scored on each row's gold class")


def _class_texts(row: Any, where: str) -> tuple[str, str]:
    if not isinstance(row, dict) or not all(isinstance(row.get(key), str) and row[key].strip()
                                            for key in ("clean", "corrupt")):
        raise ProbeError(f"{where}: expected an object with non-empty string \"clean\" and \"corrupt\" texts and "
                         "an \"answer\" and a \"distractor\" class", parameter="labels")
    return row["clean"], row["corrupt"]


def _answer_distractor(row: dict, where: str, names: list[str]) -> tuple[int, int]:
    answer, distractor = (label_index(LabelledText(row["clean"], _label(row.get(key), where, key), where=where), names,
                                      where) for key in ("answer", "distractor"))
    if answer == distractor:
        raise ProbeError(f"{where}: answer and distractor are one class ({names[answer]})", parameter="labels")
    return answer, distractor


def read_class_pairs(loaded: LoadedModel, path: str | Path) -> ContrastSet:
    """A classifier's clean/corrupt texts of one token length with two classes; a bad row is one error naming it."""
    rows = json_lines(path, "pairs file", "give a .jsonl file of clean/corrupt/answer/distractor rows", "labels")
    texts = [_class_texts(row, where) for where, row in rows]
    clean, corrupt = (_encode(loaded, [LabelledText(pair[side], 0, where=where) for (where, _), pair in
                                       zip(rows, texts)]) for side in (0, 1))
    for (where, _), one, other in zip(rows, clean, corrupt):
        if len(one) != len(other):
            raise ProbeError(f"{where}: clean is {len(one)} tokens and corrupt {len(other)}: a pair's texts must "
                             "tokenize to the same length, so that each position of one is that position of the "
                             "other", parameter="labels")
    (ids, mask), (corrupt_ids, _) = right_padded(clean, _pad_id(loaded)), right_padded(corrupt, _pad_id(loaded))
    names = class_names(loaded, class_count(loaded, ids, mask))
    chosen = [_answer_distractor(row, where, names) for where, row in rows]
    pairs = [ContrastPair(text[0], text[1], names[a], names[d]) for text, (a, d) in zip(texts, chosen)]
    return ContrastSet(Path(path).stem, f"pairs file {path}, {len(rows)} pairs", ids, corrupt_ids, mask,
                       torch.tensor([a for a, _ in chosen]), torch.tensor([d for _, d in chosen]), pairs,
                       classes=names)


register_probe_set("class_contrast", lambda loaded, options: read_class_pairs(loaded, given(options.labels)),
                   kind="class_contrast", reads=("labels",),
                   summary="sequence classifiers: a JSON-lines file of clean/corrupt texts with an answer and a "
                           "distractor class; the metric is their logit difference")

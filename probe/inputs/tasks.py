"""Task sets for the `task_margin` metric: minimal pairs (BLiMP) or prompts with an answer and a distractor, from a
JSON-lines file or generated (TASKS: sva after Marvin & Linzen 2018, ioi after Wang et al. 2022); each item is two
rows, good then bad, `scored` marking the positions that count."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from probe.inputs.sets import ProbeSet, bos_ids, check_context, encode, given, register_probe_set, right_padded
from probe.errors import ProbeError
from probe.reading import is_file, loads
from probe.models import LoadedModel

PAIR_KEYS = ("sentence_good", "sentence_bad")
PROMPT_KEYS = ("prompt", "answer", "distractor")


@dataclass(frozen=True)
class TaskItem:
    """One pair: two sentences (answer None), or a prompt with its answer and distractor."""

    good: str  # the sentence, or the prompt
    bad: str | None = None
    answer: str | None = None
    distractor: str | None = None


def text_fields(row: Any, where: str, kind: str, keys: tuple[str, ...], holds: str | None = None) -> list[str]:
    """The non-empty strings `keys` of a JSON-lines row, refused naming its line (`holds`: what a row holds)."""
    names = f"{', '.join(keys[:-1])} and {keys[-1]}"
    if not isinstance(row, dict):
        raise ProbeError(f"{where}: a {kind} row is a JSON object, not {type(row).__name__}")
    missing = [key for key in keys if key not in row]
    if missing:
        raise ProbeError(f"{where}: no {missing[0]!r}; a row holds {holds or names}")
    if not all(isinstance(row[key], str) and row[key] for key in keys):
        raise ProbeError(f"{where}: {names} must be non-empty strings")
    return [row[key] for key in keys]


def _item(row: Any, where: str) -> TaskItem:
    keys = PAIR_KEYS if isinstance(row, dict) and ("sentence_good" in row or "sentence_bad" in row) else PROMPT_KEYS
    texts = text_fields(row, where, "task", keys, "sentence_good and sentence_bad, or prompt, answer and distractor")
    return TaskItem(*texts) if keys == PAIR_KEYS else TaskItem(texts[0], answer=texts[1], distractor=texts[2])


def json_lines(path: str | Path, what: str, hint: str, parameter: str) -> list[tuple[str, Any]]:
    """(where, row) of each non-empty line of a JSON-lines file; what cannot be read refused naming FILE line N."""
    path = Path(path)
    if not is_file(path):
        raise ProbeError(f"{what} not found: {path} ({hint})", parameter=parameter)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise ProbeError(f"{what} {path} is not UTF-8 text") from None
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append((f"{path} line {number}", loads(line)))
        except json.JSONDecodeError as error:
            raise ProbeError(f"{path} line {number} is not JSON ({error.msg})") from None
    if not rows:
        raise ProbeError(f"{what} {path} holds no rows")
    return rows


def read_task_file(path: str | Path) -> list[TaskItem]:
    """The pairs of a JSON-lines task file; ProbeError naming the file and line of what is wrong."""
    return [_item(row, where) for where, row in json_lines(path, "task file", "use sva, ioi, or a .jsonl file",
                                                           "task")]


# generated tasks (word lists and templates written for probe)

NOUNS = [("author", "authors"), ("pilot", "pilots"), ("surgeon", "surgeons"), ("farmer", "farmers"),
         ("manager", "managers"), ("customer", "customers"), ("officer", "officers"), ("teacher", "teachers"),
         ("senator", "senators"), ("dancer", "dancers"), ("doctor", "doctors"), ("lawyer", "lawyers"),
         ("painter", "painters"), ("student", "students"), ("singer", "singers"), ("driver", "drivers")]
PREPOSITIONS = ["next to", "behind", "near", "with", "beside", "in front of", "from the office of"]
VERBS = [(" is", " are"), (" was", " were"), (" has", " have")]
RC_VERBS = [("likes", "like"), ("admires", "admire"), ("knows", "know"), ("hates", "hate")]
SVA_TEMPLATES = [  # (template, whether the clause's verb agrees with the subject)
    ("The {subject} {preposition} the {attractor}", True),  # prepositional phrase
    ("The {subject} that the {attractor} {rc_verb}", False),  # object relative clause: agrees with the attractor
    ("The {subject} who {rc_verb} the {attractor}", True),  # subject relative clause
]

NAMES = ["Mary", "John", "Tom", "James", "Sarah", "Anna", "David", "Paul", "Laura", "Mark", "Emma", "Peter",
         "Kate", "Mike", "Lisa", "Daniel"]
PLACES = ["store", "park", "school", "office", "station", "garden", "market", "hospital"]
OBJECTS = ["drink", "book", "letter", "ball", "gift", "key", "bag", "pen"]
IOI_TEMPLATES = [
    "When {a} and {b} went to the {place}, {s} gave a {object} to",
    "Then, {a} and {b} had a long day at the {place}. {s} handed a {object} to",
    "After {a} and {b} arrived at the {place}, {s} passed the {object} to",
    "While {a} and {b} were working at the {place}, {s} threw a {object} to",
]


@dataclass(frozen=True)
class SvaDraw:
    """One subject-verb agreement item's random choices: a template, the subject's number, the words."""

    template: str
    with_subject: bool  # whether the clause's verb agrees with the subject (else with the attractor)
    plural: bool  # the subject's number
    subject: tuple[str, str]  # (singular, plural)
    attractor: tuple[str, str]
    rc_verb: tuple[str, str]
    verb: tuple[str, str]  # the verb that follows the prompt, (singular, plural)
    preposition: str

    def prompt(self, plural: bool) -> str:
        """The prompt with the subject in the given number (the attractor keeps the other number of `self.plural`)."""
        return self.template.format(subject=self.subject[plural], attractor=self.attractor[not self.plural],
                                    preposition=self.preposition,
                                    rc_verb=self.rc_verb[plural if self.with_subject else not self.plural])


def sva_draws(count: int, seed: int) -> list[SvaDraw]:
    """The random choices of `count` agreement items: half singular; subject and attractor of opposite number."""
    rng = random.Random(seed)
    draws = []
    for index in range(count):
        template, with_subject = SVA_TEMPLATES[index % len(SVA_TEMPLATES)]
        plural = (index // len(SVA_TEMPLATES)) % 2 == 1
        subject, attractor = rng.sample(NOUNS, 2)
        rc_verb, verb = rng.choice(RC_VERBS), rng.choice(VERBS)
        draws.append(SvaDraw(template, with_subject, plural, subject, attractor, rc_verb, verb,
                             rng.choice(PREPOSITIONS)))
    return draws


def sva_items(count: int, seed: int) -> list[TaskItem]:
    """Agreement prompts: answer the verb agreeing with the subject, distractor the one agreeing with the attractor."""
    return [TaskItem(draw.prompt(draw.plural), answer=draw.verb[draw.plural], distractor=draw.verb[not draw.plural])
            for draw in sva_draws(count, seed)]


def ioi_draws(count: int, seed: int, names: int) -> list[tuple[Callable[..., str], list[str]]]:
    """IOI items, ABBA and BABA alternating: each prompt with the subject's second mention `s` left to fill, and the
    `names` names drawn (the indirect object, the subject, then the corruption's third name)."""
    rng = random.Random(seed)
    draws: list[tuple[Callable[..., str], list[str]]] = []
    for index in range(count):
        drawn = rng.sample(NAMES, names)
        first, second = drawn[:2] if index % 2 == 0 else drawn[1::-1]  # ABBA, then BABA
        template = IOI_TEMPLATES[(index // 2) % len(IOI_TEMPLATES)]
        draws.append((partial(template.format, a=first, b=second, place=rng.choice(PLACES),
                              object=rng.choice(OBJECTS)), drawn))
    return draws


def ioi_items(count: int, seed: int) -> list[TaskItem]:
    """IOI prompts, ABBA and BABA alternating: answer the indirect object, distractor the subject."""
    return [TaskItem(prompt(s=subject), answer=f" {io}", distractor=f" {subject}")
            for prompt, (io, subject) in ioi_draws(count, seed, 2)]


TASKS: dict[str, Callable[[int, int], list[TaskItem]]] = {"sva": sva_items, "ioi": ioi_items}
"""Generated tasks by name: (number of items, seed) -> items. A new task is one function here."""


# task set


def task_tokens(loaded: LoadedModel, text: str) -> list[int]:
    if loaded.tokenizer is None:
        raise ProbeError(f"a task set is text: {loaded.name} has no tokenizer", parameter="task")
    return encode(loaded.tokenizer, text)


def not_single_token(loaded: LoadedModel, item: TaskItem) -> str | None:
    """Why a prompt's answer or distractor is not one token for this model (None: both are)."""
    for what in ("answer", "distractor"):
        text = getattr(item, what)
        count = 1 if text is None else len(task_tokens(loaded, text))
        if count != 1:
            return f"{what} {text!r} is {count} tokens"
    return None


def _rows(loaded: LoadedModel, item: TaskItem, bos: list[int]) -> list[tuple[list[int], int]]:
    """(ids, first scored position) of the good and the bad row of one item."""
    if item.answer is None:
        assert item.bad is not None
        return [(bos + task_tokens(loaded, sentence), 0) for sentence in (item.good, item.bad)]
    assert item.distractor is not None  # a prompt has both (read_task_file, the generated tasks)
    prompt = bos + task_tokens(loaded, item.good)
    return [(prompt + task_tokens(loaded, word), len(prompt) - 1) for word in (item.answer, item.distractor)]


def task_items(loaded: LoadedModel, task: str | Path, count: int, seed: int) -> tuple[list[TaskItem], str, list[str]]:
    """(items, source, drops) of a task of TASKS or a file; generated items not single tokens are dropped."""
    if str(task) in TASKS:
        items, source = TASKS[str(task)](count, seed), f"{task}: generated, {count} items, seed {seed}"
        reasons = [not_single_token(loaded, item) for item in items]
        kept = [item for item, reason in zip(items, reasons) if reason is None]
        dropped = [f"{item.good!r}: {reason}" for item, reason in zip(items, reasons) if reason is not None]
        if not kept:
            raise ProbeError(f"no item of task {task} has single-token answers for this model ({dropped[0]})",
                             parameter="task")
        return kept, source, dropped
    items = read_task_file(task)
    for number, item in enumerate(items, start=1):
        why = not_single_token(loaded, item)
        if why is not None:
            raise ProbeError(f"{task} row {number}: {why} for this model; the logit difference needs single-token "
                             "answers and distractors")
    return items, f"task file {task}, {len(items)} items", []


def task_set(loaded: LoadedModel, task: str | Path, *, count: int = 32, seed: int = 0) -> ProbeSet:
    """The probe set of a task: each item as a good and a bad row (see the module docstring)."""
    items, source, dropped = task_items(loaded, task, count, seed)
    return items_set(loaded, items, Path(task).stem if str(task) not in TASKS else str(task), source, dropped)


def items_set(loaded: LoadedModel, items: list[TaskItem], name: str, source: str,
              dropped: list[str] | None = None) -> ProbeSet:
    """The probe set of task items (a good and a bad row each, `scored` marking what the metric reads)."""
    dropped = dropped or []
    bos = bos_ids(loaded.tokenizer)
    rows = [row for item in items for row in _rows(loaded, item, bos)]
    ids, mask = right_padded([tokens for tokens, _ in rows], 0)
    check_context(loaded, ids.shape[1])
    scored = torch.zeros(len(rows), ids.shape[1] - 1, dtype=torch.bool)  # position t scores token t + 1
    for row, (tokens, first) in enumerate(rows):
        scored[row, first:len(tokens) - 1] = True
    kind = "prompts" if items[0].answer is not None else "minimal pairs"
    description = f"task {source} ({len(items)} {kind}" + (f", {len(dropped)} dropped: not single tokens)"
                                                           if dropped else ")")
    return ProbeSet(f"task:{name}", description, ids, len(bos), attention_mask=mask, scored=scored,
                    meta={"task": name, "items": len(items), "kind": kind, "dropped": dropped[:20]})


register_probe_set("task", lambda loaded, options: task_set(loaded, given(options.task), count=options.num_seqs,
                                                           seed=options.seed),
                   kind="task", reads=("task",),
                   summary="a task: generated (sva, ioi; num_seqs items) or a JSON-lines file of minimal pairs or "
                           "prompts; each item a good and a bad row, the metric reads the scored positions")

"""Which probe set a command's inputs choose: the one rule every command applies to its data, labels, pairs, seq2seq
texts and task (`probe ablate`, `probe steer`, `probe prune`), so that the same inputs choose the same set
everywhere."""

from __future__ import annotations

from pathlib import Path

from probe.inputs.contrast import CONTRAST_TASKS

GENERATED = ("natural", "repeated")
"""The texts probe generates itself; any other `data` is a text file."""


def data_file(data: str) -> Path | None:
    """The text file `data` names; None where it names a generated text (GENERATED)."""
    return None if data in GENERATED else Path(data)


def probe_set_name(data: str, *, labels: Path | None = None, task: str | None = None, pairs: Path | None = None,
                   seq2seq: Path | None = None, contrast: bool = False, compared: bool = False) -> str:
    """The name in PROBE_SETS of the set these inputs choose: labelled texts, an encoder-decoder's source/target texts
    (`seq2seq`), clean/corrupt pairs, a task, or text (a file is natural). `contrast`: the caller measures a logit
    difference, so that a task of CONTRAST_TASKS is its clean/corrupt pairs too; `compared`: the caller runs the clean
    and the corrupt prompts both (patching), so that a classifier's labels file holds clean/corrupt texts."""
    if pairs is not None or (contrast and task in CONTRAST_TASKS):
        return "contrast"
    if labels is not None:
        return "class_contrast" if contrast and task is None and compared else "labels"
    if seq2seq is not None:
        return "seq2seq"
    if task is not None:
        return "task"
    return "repeated" if data == "repeated" else "natural"

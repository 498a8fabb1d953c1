"""Which probe set a command's inputs choose: one rule, so that the same inputs choose the same set everywhere."""

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
    """The PROBE_SETS name these inputs choose; `contrast`: a task as its pairs; `compared`: a labels file of pairs."""
    if pairs is not None or (contrast and task in CONTRAST_TASKS):
        return "contrast"
    if labels is not None:
        return "class_contrast" if contrast and task is None and compared else "labels"
    if seq2seq is not None:
        return "seq2seq"
    if task is not None:
        return "task"
    return "repeated" if data == "repeated" else "natural"

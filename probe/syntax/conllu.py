"""Dependency parses as probe reads them (`Sentence`), and the CoNLL-U reader."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NoReturn
from pathlib import Path

from probe.errors import ProbeError
from probe.reading import is_file

ROOT = -1  # the head of the sentence's root word
NUMBER = re.compile(r"[0-9]+")
"""An ID or HEAD: ASCII digits (str.isdigit passes '²', which int() refuses)."""


@dataclass
class Sentence:
    """One parsed sentence: words, each word's head (0-based index, ROOT for the root) and relation."""

    words: list[str]
    heads: list[int]
    relations: list[str]
    text: str
    spans: list[tuple[int, int]]  # (start, end) of each word in `text`
    where: str  # "FILE:LINE" of its first line, or "sentence N of TEXT"

    def arcs(self) -> list[tuple[int, int, str]]:
        """(dependent, head, relation) of every arc but the root's."""
        return [(dep, head, rel) for dep, (head, rel) in enumerate(zip(self.heads, self.relations)) if head != ROOT]


def _fail(where: str, message: str) -> NoReturn:
    raise ProbeError(f"{where}: {message}")  # FILE:LINE names the input


def _word(fields: list[str], where: str, expected: int) -> tuple[str, int, str, bool]:
    """(form, head index (0: root), relation, space after) of one word line, checked."""
    if len(fields) != 10:
        _fail(where, f"a CoNLL-U word line has 10 tab-separated fields, this one has {len(fields)}")
    if not NUMBER.fullmatch(fields[0]) or int(fields[0]) != expected:
        _fail(where, f"word ID {fields[0]!r} where {expected} was expected (IDs count 1, 2, ... in each sentence)")
    if not NUMBER.fullmatch(fields[6]):
        _fail(where, f"HEAD must be a word ID or 0 (the root), got {fields[6]!r}")
    if fields[7] in ("", "_"):
        _fail(where, "DEPREL is missing: every word needs its relation to its head")
    space = "SpaceAfter=No" not in fields[9].split("|")
    return fields[1], int(fields[6]), fields[7].split(":")[0].lower(), space


def _finish(rows: list[tuple[str, int, str, bool]], where: str, count: int) -> Sentence:
    """The sentence of its word lines, its text the words written out, a space after those with one after them."""
    heads = [head - 1 if head else ROOT for _, head, _, _ in rows]
    for index, head in enumerate(heads):
        if head >= len(rows):
            _fail(where, f"word {index + 1} names head {head + 1}, but sentence {count} has {len(rows)} words")
    text, spans = "", []
    for word, _, _, space in rows:
        spans.append((len(text), len(text) + len(word)))
        text += word + (" " if space else "")
    end = spans[-1][1] if spans else 0  # the last word's own end: a form ending in a space keeps it
    return Sentence([r[0] for r in rows], heads, [r[2] for r in rows], text[:end], spans, where)


def read_conllu(path: str | Path) -> list[Sentence]:
    """Every sentence of a CoNLL-U file: multi-word and empty-node lines skipped, relations cut to their universal
    part, the text the words written out (SpaceAfter=No kept); a malformed line is one ProbeError naming FILE:LINE."""
    file = Path(path)
    if not is_file(file):
        raise ProbeError(f"conllu: file not found: {file}", parameter="conllu")
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise ProbeError(f"conllu: {file} is not UTF-8 text: {error.reason}", parameter="conllu") from error
    sentences: list[Sentence] = []
    rows: list[tuple[str, int, str, bool]] = []
    start = ""
    for number, line in enumerate([*lines, ""], start=1):
        where = f"{file}:{number}"
        if not line.strip():
            if rows:
                sentences.append(_finish(rows, start, len(sentences) + 1))
            rows = []
            continue
        if line.startswith("#"):
            continue
        fields = line.split("\t")
        if "-" in fields[0] or "." in fields[0]:
            continue  # a multi-word token or an empty node
        start = start if rows else where
        rows.append(_word(fields, where, len(rows) + 1))
    if not sentences:
        raise ProbeError(f"conllu: {file} holds no sentence (CoNLL-U: one word per line, a blank line after each "
                         "sentence)", parameter="conllu")
    return sentences

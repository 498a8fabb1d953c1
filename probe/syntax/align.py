"""Words <-> tokens through the tokenizer's offsets, and word-level attention (Clark et al. 2019, section 4.1): to a
split word the sum over its tokens, from it the mean."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from probe.errors import ProbeError
from probe.inputs.sets import wrapping
from probe.syntax.conllu import Sentence


@dataclass
class Aligned:
    """A sentence with its token ids (BOS first where the tokenizer has one) and each word's token positions."""

    sentence: Sentence
    ids: list[int]
    members: list[list[int]]  # per word, the positions of its tokens in `ids` (a token may lie in two words)

    def token_words(self) -> list[int]:
        """Per token position, the first word it lies in; -1 for BOS and tokens in no word."""
        owner = [-1] * len(self.ids)
        for word, positions in enumerate(self.members):
            for position in positions:
                if owner[position] < 0:
                    owner[position] = word
        return owner

    def matrices(self) -> tuple[Tensor, Tensor]:
        """(from, to), each (words, tokens): `from` averages a word's tokens, `to` sums them."""
        to = torch.zeros(len(self.members), len(self.ids))
        for word, positions in enumerate(self.members):
            to[word, positions] = 1.0
        return to / to.sum(dim=1, keepdim=True), to


def word_attention(weights: Tensor, aligned: Aligned) -> Tensor:
    """Token attention -> word attention: rows averaged over a word's tokens, columns summed; other tokens drop out."""
    source, target = aligned.matrices()
    return source @ weights @ target.T


def _offsets(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, TypeError, ValueError):
        encoded = None
    offsets = encoded.get("offset_mapping") if hasattr(encoded, "get") else None
    if offsets is None:
        raise ProbeError("the model's tokenizer gives no character offsets (return_offsets_mapping), so words "
                         "cannot be matched to tokens: use a model with a fast (Rust) tokenizer", parameter="model")
    return list(encoded["input_ids"]), [tuple(pair) for pair in offsets]


def align(tokenizer: Any, sentence: Sentence, encoder: bool = False) -> Aligned:
    """Each word's tokens by character-span overlap, `wrapping` around; a word no token overlaps is a ProbeError."""
    if tokenizer is None:
        raise ProbeError("the model has no tokenizer, so words cannot be matched to tokens", parameter="model")
    ids, offsets = _offsets(tokenizer, sentence.text)
    prefix, suffix = wrapping(tokenizer, encoder)
    first = len(prefix)
    members = []
    for index, (start, end) in enumerate(sentence.spans):
        covering = [first + position for position, (left, right) in enumerate(offsets)
                    if left < end and right > start]
        if not covering:
            raise ProbeError(f"{sentence.where}: no token covers word {index + 1} {sentence.words[index]!r}: the "
                             "tokenizer's offsets do not match the text")
        members.append(covering)
    return Aligned(sentence, prefix + ids + suffix, members)

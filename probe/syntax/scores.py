"""Syntactic heads, by Clark et al. 2019 (section 4.2) and, for causal models, Vig & Belinkov 2019. Each head is a
classifier: for a query word, the word it attends to most; its accuracy on a relation is the share of arcs whose
other end it predicts, per direction (a causal model sees each arc once, from its later word). Baseline: the best
fixed relative offset (-3..+2); syntactic: accuracy above it by MARGIN on a relation with MIN_COUNT arcs. Confident
attention: of a head's weights above CONFIDENT, the share linking two words joined by an arc. Words are matched to
tokens through the tokenizer's offsets, and attention made word-level as Clark et al. (section 4.1) make it: to a
split word the sum over its tokens, from it the mean."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from probe.errors import ProbeError
from probe.inputs.sets import wrapping
from probe.syntax.conllu import Sentence

OFFSETS = (-3, -2, -1, 1, 2)  # Clark et al.'s fixed-offset baselines, relative to the query word
MIN_COUNT = 20  # arcs a relation needs in one direction to be judged
MARGIN = 0.10  # accuracy above the baseline that makes a head syntactic for a relation
CONFIDENT = 0.4  # Vig & Belinkov's threshold of a confident attention weight
TO_HEAD, TO_DEPENDENT = "dep->head", "head->dep"


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


def word_attention(weights: Tensor, aligned: Aligned) -> Tensor:
    """Token attention -> word attention: rows averaged over a word's tokens, columns summed; other tokens drop out."""
    target = torch.zeros(len(aligned.members), len(aligned.ids))  # (words, tokens)
    for word, positions in enumerate(aligned.members):
        target[word, positions] = 1.0
    return target / target.sum(dim=1, keepdim=True) @ weights @ target.T


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


@dataclass(frozen=True)
class Scheme:
    """A label scheme: relations are counted per scheme, since the same arc gets different labels (and heads)."""

    title: str
    relations: tuple[str, ...]  # report order; labels outside it follow, alphabetically


SCHEMES = {
    "ud": Scheme("Universal Dependencies (content words are heads)", (
        "nsubj", "obj", "iobj", "csubj", "ccomp", "xcomp", "obl", "vocative", "expl", "dislocated", "advcl",
        "advmod", "discourse", "aux", "cop", "mark", "nmod", "appos", "nummod", "acl", "amod", "det", "clf",
        "case", "conj", "cc", "fixed", "flat", "compound", "list", "parataxis", "orphan", "goeswith",
        "reparandum", "punct", "dep")),
    "clearnlp": Scheme("ClearNLP, spaCy's English labels (function words head their phrase)", (
        "nsubj", "nsubjpass", "dobj", "iobj", "dative", "attr", "acomp", "oprd", "csubj", "csubjpass", "ccomp",
        "xcomp", "advcl", "advmod", "neg", "npadvmod", "aux", "auxpass", "mark", "prep", "pobj", "pcomp", "agent",
        "det", "predet", "poss", "amod", "nummod", "quantmod", "compound", "nmod", "appos", "acl", "relcl",
        "case", "cc", "conj", "preconj", "prt", "expl", "intj", "parataxis", "meta", "punct", "dep")),
}


def queries(aligned: Aligned, causal: bool) -> list[tuple[int, int, str, str]]:
    """(query word, target word, relation, direction) of every arc, in each direction it is scored in."""
    out = []
    for dep, head, relation in aligned.sentence.arcs():
        if not causal:
            out += [(dep, head, relation, TO_HEAD), (head, dep, relation, TO_DEPENDENT)]
        elif head < dep:
            out.append((dep, head, relation, TO_HEAD))
        else:
            out.append((head, dep, relation, TO_DEPENDENT))
    return out


@dataclass
class RelationTally:
    """Running counts of one relation in one direction."""

    hits: Tensor  # (layers, heads) float64: arcs each head predicts
    count: int = 0
    offsets: Counter = field(default_factory=Counter)  # offset -> arcs at that offset from the query

    def accuracy(self) -> Tensor:
        return self.hits / max(self.count, 1)

    def baseline(self) -> tuple[int, float]:
        """(offset, accuracy) of the best fixed offset (the nearer one wins a tie)."""
        best = max(OFFSETS, key=lambda offset: (self.offsets[offset], -abs(offset)))
        return best, self.offsets[best] / max(self.count, 1)


class SyntaxTally:
    """Every head's hits per (relation, direction) and confident attention, sentence by sentence."""

    def __init__(self, n_layers: int, n_heads: int, causal: bool, confident: float = CONFIDENT) -> None:
        self.shape, self.causal, self.confident = (n_layers, n_heads), causal, confident
        self.relations: dict[tuple[str, str], RelationTally] = {}
        self.on_arcs = torch.zeros(n_layers, n_heads, dtype=torch.float64)
        self.confident_mass = torch.zeros_like(self.on_arcs)

    def add(self, aligned: Aligned, weights: Tensor) -> Tensor | None:
        """One sentence's token attention in; its arcs' predictions (layers, heads, queries) out (None: no arc): the
        word each head attends to most from each query word, not itself, nor a later word where causal."""
        self._add_confident(aligned, weights)
        scored = queries(aligned, self.causal)
        if not scored:
            return None
        words = word_attention(weights, aligned)
        asking, keys = torch.tensor([q for q, _, _, _ in scored]), torch.arange(words.shape[-1])
        allowed = keys[None, :] != asking[:, None]  # (queries, words)
        if self.causal:
            allowed &= keys[None, :] < asking[:, None]
        predicted = words[:, :, asking, :].masked_fill(~allowed, float("-inf")).argmax(dim=-1)
        for index, (query, target, relation, direction) in enumerate(scored):
            tally = self.relations.setdefault((relation, direction),
                                              RelationTally(torch.zeros(self.shape, dtype=torch.float64)))
            tally.hits += (predicted[:, :, index] == target).double()
            tally.count += 1
            tally.offsets[target - query] += 1
        return predicted

    def _add_confident(self, aligned: Aligned, weights: Tensor) -> None:
        owner = torch.tensor(aligned.token_words())  # (tokens,)
        n_words = len(aligned.sentence.words)
        linked = torch.zeros(n_words + 1, n_words + 1, dtype=torch.bool)  # the last row / column: no word
        for dep, head, _ in aligned.sentence.arcs():
            linked[dep, head] = linked[head, dep] = True
        index = owner.clamp(min=-1) % (n_words + 1)  # -1 -> the "no word" slot
        on_arc = linked[index[:, None], index[None, :]]  # (tokens, tokens)
        in_words = (owner >= 0)[:, None] & (owner >= 0)[None, :]
        confident = (weights > self.confident) & in_words  # (layers, heads, tokens, tokens)
        mass = weights.double() * confident
        self.confident_mass += mass.sum(dim=(-1, -2))
        self.on_arcs += (mass * on_arc).sum(dim=(-1, -2))

    def confident_share(self) -> Tensor:
        """(layers, heads): the share of confident attention on dependency arcs (0 where a head has none)."""
        return self.on_arcs / self.confident_mass.clamp(min=1e-12)

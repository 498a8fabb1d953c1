"""Syntactic heads, by Clark et al. 2019 (section 4.2) and, for causal models, Vig & Belinkov 2019. Each head is a
classifier: for a query word, the word it attends to most; its accuracy on a relation is the share of arcs whose
other end it predicts, per direction (a causal model sees each arc once, from its later word). Baseline: the best
fixed relative offset (-3..+2); syntactic: accuracy above it by MARGIN on a relation with MIN_COUNT arcs. Confident
attention: of a head's weights above CONFIDENT, the share linking two words joined by an arc."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import Tensor

from probe.syntax.align import Aligned, word_attention

OFFSETS = (-3, -2, -1, 1, 2)  # Clark et al.'s fixed-offset baselines, relative to the query word
MIN_COUNT = 20  # arcs a relation needs in one direction to be judged
MARGIN = 0.10  # accuracy above the baseline that makes a head syntactic for a relation
CONFIDENT = 0.4  # Vig & Belinkov's threshold of a confident attention weight
TO_HEAD, TO_DEPENDENT = "dep->head", "head->dep"


@dataclass(frozen=True)
class Scheme:
    """A label scheme: relations are counted per scheme, since the same arc gets different labels (and heads)."""

    name: str
    title: str
    relations: tuple[str, ...]  # report order; labels outside it follow, alphabetically


SCHEMES = {
    "ud": Scheme("ud", "Universal Dependencies (content words are heads)", (
        "nsubj", "obj", "iobj", "csubj", "ccomp", "xcomp", "obl", "vocative", "expl", "dislocated", "advcl",
        "advmod", "discourse", "aux", "cop", "mark", "nmod", "appos", "nummod", "acl", "amod", "det", "clf",
        "case", "conj", "cc", "fixed", "flat", "compound", "list", "parataxis", "orphan", "goeswith",
        "reparandum", "punct", "dep")),
    "clearnlp": Scheme("clearnlp", "ClearNLP, spaCy's English labels (function words head their phrase)", (
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


def predictions(words: Tensor, query_words: list[int], causal: bool) -> Tensor:
    """The word each head attends to most from each query word (not itself, nor a later word where causal)."""
    n = words.shape[-1]
    query = torch.tensor(query_words)
    keys = torch.arange(n)
    allowed = keys[None, :] != query[:, None]  # (queries, n)
    if causal:
        allowed &= keys[None, :] < query[:, None]
    rows = words[:, :, query, :].masked_fill(~allowed, float("-inf"))
    return rows.argmax(dim=-1)


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
        """One sentence's token attention in; its arcs' predictions (layers, heads, queries) out (None: no arc)."""
        self._add_confident(aligned, weights)
        scored = queries(aligned, self.causal)
        if not scored:
            return None
        predicted = predictions(word_attention(weights, aligned), [q for q, _, _, _ in scored], self.causal)
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

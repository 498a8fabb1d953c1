"""`SyntaxResult`: what `probe syntax` measured, and its plain `to_dict()` payload for the reports; the `syntactic` head
class it adds to a classification when parses are given (`probe classify --conllu`), a head being syntactic exactly
when `probe syntax` calls it so (scored on parses, so an extra class, not one of SCORES)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from probe.frames import frame, head_columns
from probe.heads.classify import Classification
from probe.schemas.base import Field
from probe.schemas.common import DTYPE, HEAD, HEAD_COLUMNS, LAYER, MODEL, N_HEADS, N_LAYERS
from probe.schemas.declare import Payload, payload, published, schema_field
from probe.syntax.scores import SCHEMES, RelationTally

TOP_HEADS = 5  # best heads listed per relation


class RelationEntry(Payload, frozen=True):
    """One relation and direction: its arcs, the positional baseline, the best heads and every head's accuracy."""

    relation: str = schema_field("the relation")
    direction: str = schema_field("dep->head or head->dep")
    count: int = schema_field("its arcs")
    judged: bool = schema_field("count >= min_count")
    baseline: float = schema_field("the best fixed-offset accuracy")
    baseline_offset: int = schema_field("that offset")
    best: list[dict[str, Any]] = schema_field("the best heads")
    accuracy: list[list[float]] = schema_field("every head's accuracy, layers x heads")


class SyntacticHead(Payload, frozen=True):
    """A head syntactic for some relation."""

    layer: int = schema_field(LAYER)
    head: int = schema_field(HEAD)
    relations: list[str] = schema_field("'relation direction' names")


@published("syntax", 1, "Syntactic heads: per dependency relation and direction, each head's accuracy against the best "
           "positional baseline (probe syntax --json).", rows="one per head and relation (and direction)",
           columns={**HEAD_COLUMNS, "relation": Field("string", "the relation"),
                    "direction": Field("string", "dep->head or head->dep"), "count": Field("integer", "its arcs"),
                    "judged": Field("boolean", "whether the relation has enough arcs"),
                    "accuracy": Field("number", "the head's accuracy on it"),
                    "baseline": Field("number", "the best fixed-offset accuracy"),
                    "margin": Field("number", "accuracy - baseline"),
                    "syntactic": Field("boolean", "judged and above the margin")})
class SyntaxResult(Payload):
    """Per (relation, direction): every head's accuracy, arc count and baseline; and each head's confident attention."""

    model: str = schema_field(MODEL)
    scheme: str = schema_field("the dependency scheme")  # a key of SCHEMES

    @payload("its title")
    def scheme_title(self) -> str:
        return SCHEMES[self.scheme].title

    source: str = schema_field("the parsed corpus")
    causal: bool = schema_field("whether the model is causal (a dependent sees only earlier words)")
    n_layers: int = schema_field(N_LAYERS)
    n_heads: int = schema_field(N_HEADS)
    dtype: str = schema_field(DTYPE, default="float32", kw_only=True)  # docs/precision.md: how far half precision lies
    sentences: int = schema_field("sentences read")
    words: int = schema_field("words read")
    relations: dict[tuple[str, str], RelationTally]
    confident_share: Tensor  # (layers, heads)
    confident: float
    min_count: int = schema_field("arcs a relation needs to be judged")
    margin: float = schema_field("how far above the baseline a syntactic head's accuracy is")

    @payload("each relation and direction", key="relations", items="a relation")
    def relation_entries(self) -> list[RelationEntry]:
        return [self._relation_entry(key) for key in self.ordered()]

    @payload("the heads syntactic for some relation", key="syntactic", items="a head")
    def syntactic_heads(self) -> list[SyntacticHead]:
        return [SyntacticHead(layer, head, names) for (layer, head), names in sorted(self.syntactic().items())]

    @payload("the share of confident rows per head", key="confident")
    def confidence(self) -> dict[str, Any]:
        return {"threshold": self.confident,
                "share": [[round(float(v), 4) for v in row] for row in self.confident_share]}

    skipped: list[str] = schema_field("what was skipped and why", default_factory=list,
                                      dump=lambda skipped: list(skipped))
    examples: list[dict[str, Any]] = schema_field("sentences with their arcs and each head's hits",
                                                  default_factory=list)

    def ordered(self) -> list[tuple[str, str]]:
        """(relation, direction) keys in the scheme's order, then the others, most arcs first within a relation."""
        order = {name: index for index, name in enumerate(SCHEMES[self.scheme].relations)}
        return sorted(self.relations, key=lambda key: (order.get(key[0], len(order)), key[0],
                                                       -self.relations[key].count, key[1]))

    def margins(self, key: tuple[str, str]) -> Tensor:
        """(layers, heads) accuracy minus baseline, to 9 decimals: exactly the margin is not pushed over it."""
        tally = self.relations[key]
        return torch.round((tally.accuracy() - tally.baseline()[1]) * 1e9) / 1e9

    def judged(self) -> list[tuple[str, str]]:
        """The keys with at least `min_count` arcs."""
        return [key for key in self.ordered() if self.relations[key].count >= self.min_count]

    def excess(self) -> Tensor:
        """(layers, heads) each head's largest accuracy minus baseline (-1 where none is judged), against `margin`."""
        best = torch.full((self.n_layers, self.n_heads), -1.0, dtype=torch.float64)
        for key in self.judged():
            best = torch.maximum(best, self.margins(key))
        return best

    def syntactic(self) -> dict[tuple[int, int], list[str]]:
        """(layer, head) -> the 'relation dir' labels it is syntactic for."""
        heads: dict[tuple[int, int], list[str]] = {}
        for relation, direction in self.judged():
            beats = (self.margins((relation, direction)) > self.margin).nonzero().tolist()
            for layer, head in beats:
                heads.setdefault((layer, head), []).append(f"{relation} {direction}")
        return heads

    def _relation_entry(self, key: tuple[str, str]) -> RelationEntry:
        tally = self.relations[key]
        accuracy = tally.accuracy()
        offset, baseline = tally.baseline()
        order = accuracy.flatten().argsort(descending=True, stable=True)[:TOP_HEADS].tolist()
        best = [{"layer": i // self.n_heads, "head": i % self.n_heads,
                 "accuracy": round(float(accuracy.flatten()[i]), 4),
                 "margin": round(float(accuracy.flatten()[i]) - baseline, 4)} for i in order]
        return RelationEntry(key[0], key[1], tally.count, tally.count >= self.min_count, round(baseline, 4), offset,
                             best, [[round(float(v), 4) for v in row] for row in accuracy])

    def to_frame(self) -> Any:
        """A pandas DataFrame, one row per head, relation and direction: the syntax schema's columns."""
        syntactic = self.syntactic()
        return frame([{**head_columns(layer, head), "relation": entry.relation, "direction": entry.direction,
                       "count": entry.count, "judged": entry.judged, "accuracy": accuracy,
                       "baseline": entry.baseline, "margin": round(accuracy - entry.baseline, 4),
                       "syntactic": f"{entry.relation} {entry.direction}" in syntactic.get((layer, head), ())}
                      for entry in self.relation_entries for layer, row in enumerate(entry.accuracy)
                      for head, accuracy in enumerate(row)])


SYNTACTIC = "syntactic"
SYNTACTIC_CLASS = {"summary": "beats the best fixed-offset baseline at finding a dependency relation's other word "
                              "(Clark et al. 2019); score: accuracy minus baseline, best relation",
                   "letter": "Y", "probe_set": "syntax"}
"""The class as reports describe it (its threshold is the syntax result's margin); the docs' class lists read it."""


def add_syntactic(classification: Classification, result: SyntaxResult) -> Classification:
    """Add the syntactic class's scores, threshold and description to `classification` (in place; returned)."""
    if (result.n_layers, result.n_heads) != (classification.n_layers, classification.n_heads):
        raise ValueError("the syntax result is of another model than the classification")
    classification.scores[SYNTACTIC] = result.excess().float()
    classification.thresholds[SYNTACTIC] = result.margin
    classification.extra_classes[SYNTACTIC] = {**SYNTACTIC_CLASS, "default_threshold": result.margin}
    classification.probe_sets["syntax"] = {
        "name": "syntax", "description": f"syntax: {result.source}, {result.sentences} sentences, label scheme "
                                         f"{result.scheme}", "num_seqs": result.sentences}
    return classification

"""`SyntaxResult`: what `probe syntax` measured, and its plain `to_dict()` payload for the reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from probe.frames import frame, head_columns
from probe.syntax.scores import SCHEMES, RelationTally

TOP_HEADS = 5  # best heads listed per relation


@dataclass
class SyntaxResult:
    """Per (relation, direction): every head's accuracy, the arc count and the best fixed-offset baseline; and every
    head's share of confident attention on arcs."""

    model: str
    scheme: str  # a key of SCHEMES
    source: str
    causal: bool
    n_layers: int
    n_heads: int
    sentences: int
    words: int
    relations: dict[tuple[str, str], RelationTally]
    confident_share: Tensor  # (layers, heads)
    confident: float
    min_count: int
    margin: float
    skipped: list[str] = field(default_factory=list)
    examples: list[dict[str, Any]] = field(default_factory=list)
    dtype: str = "float32"  # what the model ran in: docs/precision.md says how far a half-precision run lies

    def ordered(self) -> list[tuple[str, str]]:
        """(relation, direction) keys in the scheme's order, then the others, most arcs first within a relation."""
        order = {name: index for index, name in enumerate(SCHEMES[self.scheme].relations)}
        return sorted(self.relations, key=lambda key: (order.get(key[0], len(order)), key[0],
                                                       -self.relations[key].count, key[1]))

    def margins(self, key: tuple[str, str]) -> Tensor:
        """(layers, heads): accuracy minus the baseline, rounded to 9 decimals so that a difference of exactly the
        margin (16/20 - 14/20) is not pushed over it by floating-point error."""
        tally = self.relations[key]
        return torch.round((tally.accuracy() - tally.baseline()[1]) * 1e9) / 1e9

    def judged(self) -> list[tuple[str, str]]:
        """The keys with at least `min_count` arcs."""
        return [key for key in self.ordered() if self.relations[key].count >= self.min_count]

    def excess(self) -> Tensor:
        """(layers, heads): each head's largest accuracy minus baseline over the judged relations (-1 where none is
        judged); a head is syntactic where this exceeds `margin`."""
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

    def _relation_entry(self, key: tuple[str, str]) -> dict[str, Any]:
        tally = self.relations[key]
        accuracy = tally.accuracy()
        offset, baseline = tally.baseline()
        order = accuracy.flatten().argsort(descending=True, stable=True)[:TOP_HEADS].tolist()
        best = [{"layer": i // self.n_heads, "head": i % self.n_heads,
                 "accuracy": round(float(accuracy.flatten()[i]), 4),
                 "margin": round(float(accuracy.flatten()[i]) - baseline, 4)} for i in order]
        return {"relation": key[0], "direction": key[1], "count": tally.count, "judged": tally.count >= self.min_count,
                "baseline": round(baseline, 4), "baseline_offset": offset, "best": best,
                "accuracy": [[round(float(v), 4) for v in row] for row in accuracy]}

    def to_dict(self) -> dict[str, Any]:
        scheme = SCHEMES[self.scheme]
        share = self.confident_share
        return {
            "model": self.model, "scheme": scheme.name, "scheme_title": scheme.title, "source": self.source,
            "causal": self.causal, "n_layers": self.n_layers, "n_heads": self.n_heads, "dtype": self.dtype,
            "sentences": self.sentences, "words": self.words, "min_count": self.min_count, "margin": self.margin,
            "relations": [self._relation_entry(key) for key in self.ordered()],
            "syntactic": [{"layer": layer, "head": head, "relations": names}
                          for (layer, head), names in sorted(self.syntactic().items())],
            "confident": {"threshold": self.confident,
                          "share": [[round(float(v), 4) for v in row] for row in share]},
            "skipped": list(self.skipped),
            "examples": self.examples,
        }

    def to_frame(self) -> Any:
        """A pandas DataFrame, one row per head and relation (and direction): its accuracy, the baseline, the margin
        between them, and whether it is syntactic for it (the syntax schema's columns). Needs pandas."""
        payload, syntactic = self.to_dict(), self.syntactic()
        return frame([{**head_columns(layer, head), "relation": entry["relation"], "direction": entry["direction"],
                       "count": entry["count"], "judged": entry["judged"], "accuracy": accuracy,
                       "baseline": entry["baseline"], "margin": round(accuracy - entry["baseline"], 4),
                       "syntactic": f"{entry['relation']} {entry['direction']}" in syntactic.get((layer, head), ())}
                      for entry in payload["relations"] for layer, row in enumerate(entry["accuracy"])
                      for head, accuracy in enumerate(row)])

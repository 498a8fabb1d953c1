"""The `syntactic` head class, added to a classification when parses are given (`probe classify --conllu`): a head is
syntactic exactly when `probe syntax` calls it so; scored on parses, so an extra class, not one of SCORES."""

from __future__ import annotations

from probe.heads.classify import Classification
from probe.syntax.result import SyntaxResult

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

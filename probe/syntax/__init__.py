"""Syntactic-dependency heads (Clark et al. 2019; Vig & Belinkov 2019), from CoNLL-U or spaCy parses."""

from probe.syntax.conllu import Sentence, read_conllu
from probe.syntax.result import SyntaxResult
from probe.syntax.run import syntax_scores
from probe.syntax.scores import SCHEMES

__all__ = ["SCHEMES", "Sentence", "SyntaxResult", "read_conllu", "syntax_scores"]

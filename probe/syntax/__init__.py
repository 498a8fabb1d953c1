"""Syntactic-dependency heads (Clark et al. 2019; Vig & Belinkov 2019 for causal models): parses from CoNLL-U
(`conllu`) or spaCy (`parse`, an optional extra), words aligned to tokens (`align`), the scores and baselines
(`scores`), the run over a model (`run`) and its result (`result`); `classes` adds a `syntactic` class to a
head classification."""

from probe.syntax.conllu import Sentence, read_conllu
from probe.syntax.result import SyntaxResult
from probe.syntax.run import syntax_scores
from probe.syntax.scores import SCHEMES

__all__ = ["SCHEMES", "Sentence", "SyntaxResult", "read_conllu", "syntax_scores"]

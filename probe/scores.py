"""Old import path of `probe.heads.scores` and `probe.heads.accumulate`, kept for scripts and benchmarks."""

from probe.heads.accumulate import ScoreAccumulator
from probe.heads.scores import (SCORES, Batch, Finish, Reduce, Score, duplicate_token_score, finish_positional,
                                induction_score, mean_score, next_token_score, positional_score, previous_token_score,
                                register_score, sink_score)

__all__ = ["SCORES", "Batch", "Finish", "Reduce", "Score", "ScoreAccumulator", "duplicate_token_score",
           "finish_positional", "induction_score", "mean_score", "next_token_score", "positional_score",
           "previous_token_score", "register_score", "sink_score"]

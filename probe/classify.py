"""Old import path of `probe.heads.classify` (`from probe.classify import classify` keeps working)."""

from probe.heads.classify import Classification, Progress, classify, forward, score_heads

__all__ = ["Classification", "Progress", "classify", "forward", "score_heads"]

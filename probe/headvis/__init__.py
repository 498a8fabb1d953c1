"""Neuronpedia HeadVis's per-head metrics (`head_metrics`) and its formats (probe.headvis.tree)."""

from probe.headvis.metrics import METRICS
from probe.headvis.result import HeadVisMetrics
from probe.headvis.run import head_metrics

__all__ = ["METRICS", "HeadVisMetrics", "head_metrics"]

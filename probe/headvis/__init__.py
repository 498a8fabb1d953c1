"""Neuronpedia HeadVis's per-head metrics (`head_metrics`, `HeadVisMetrics`), read from fused attention statistics,
and its formats: the published head-metrics JSON and the HeadVis frontend's data tree (probe.headvis.tree)."""

from probe.headvis.metrics import METRICS
from probe.headvis.result import HeadVisMetrics
from probe.headvis.run import head_metrics

__all__ = ["METRICS", "HeadVisMetrics", "head_metrics"]

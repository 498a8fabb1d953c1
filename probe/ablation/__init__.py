"""Ablate attention heads and measure what the model loses: zero and mean ablation, exact sweeps, fast estimates.

Modules, each with one job, data flowing one way (heads -> statistics/methods -> blocks -> metrics ->
runners -> sweep/estimate -> results/stream): see docs/architecture.md.
"""

from probe.ablation.estimate import estimate
from probe.ablation.heads import Ablation, Head, all_heads, label, parse_heads
from probe.ablation.methods import (METHODS, AblationMethod, MeanAblation, MethodInputs, ResampleAblation, ZeroAblation,
                                    ablate, build_method, register_method)
from probe.ablation.metrics import METRICS, Metric, choose_metric, register_metric
from probe.ablation.statistics import STATISTICS, HeadMeans, HeadStatistics, head_means, head_statistics
from probe.ablation.results import AblationResult, HeadResult
from probe.ablation.stream import RESULTS_FORMAT, load_results, read_results
from probe.ablation.sweep import MODES, sweep
from probe.progress import Progress

# the public API: docs/reference/ablation.md has each
__all__ = ["METHODS", "METRICS", "MODES", "RESULTS_FORMAT", "STATISTICS", "Ablation", "AblationMethod",
           "AblationResult", "Head", "HeadMeans", "HeadResult", "HeadStatistics", "MeanAblation", "MethodInputs",
           "Metric", "Progress", "ResampleAblation", "ZeroAblation", "ablate", "all_heads", "build_method",
           "choose_metric", "estimate", "head_means", "head_statistics", "label", "load_results", "parse_heads",
           "read_results", "register_method", "register_metric", "sweep"]

"""Ablate attention heads and measure what the model loses: zero and mean ablation, exact sweeps, fast estimates.

Modules, each with one job, data flowing one way (heads -> methods/means -> editor -> blocks/logits -> metrics ->
runners -> plan -> sweep/estimate -> results/stream): see docs/architecture.md.
"""

from probe.ablation.editor import ablate
from probe.ablation.estimate import estimate
from probe.ablation.heads import Ablation, Head, ablation_list, all_heads, distinct, label, parse_heads
from probe.ablation.means import HeadMeans, head_means
from probe.ablation.methods import METHODS, AblationMethod, MeanAblation, ResampleAblation, ZeroAblation
from probe.ablation.metrics import METRICS, Metric
from probe.ablation.plan import assign_chunks
from probe.ablation.results import AblationResult, HeadResult
from probe.ablation.stream import RESULTS_FORMAT, load_results, read_results, write_stream
from probe.ablation.sweep import MODES, Progress, sweep

__all__ = ["METHODS", "METRICS", "MODES", "RESULTS_FORMAT", "Ablation", "AblationMethod", "AblationResult", "Head",
           "HeadMeans", "HeadResult", "MeanAblation", "Metric", "Progress", "ResampleAblation", "ZeroAblation", "ablate",
           "ablation_list", "all_heads", "assign_chunks", "distinct", "estimate", "head_means",
           "label", "load_results", "parse_heads", "read_results", "sweep", "write_stream"]

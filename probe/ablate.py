"""The public ablation API (the code lives in probe.ablation): zero and mean ablation, exact sweeps, fast estimates.

    from probe.ablate import ablate, sweep, estimate, head_means
"""

from __future__ import annotations

from probe.ablation import (METHODS, METRICS, MODES, Ablation, AblationResult, Head, HeadMeans, HeadResult, ablate,
                            all_heads, estimate, head_means, label, load_results, parse_heads, read_results, sweep)
from probe.ablation.estimate import BACKWARD_COST, ESTIMATE_BUDGET, GRAD_FORWARD_COST

__all__ = ["BACKWARD_COST", "ESTIMATE_BUDGET", "GRAD_FORWARD_COST", "METHODS", "METRICS", "MODES", "Ablation",
           "AblationResult", "Head", "HeadMeans", "HeadResult", "ablate", "all_heads", "estimate", "head_means",
           "label", "load_results", "parse_heads", "read_results", "sweep"]


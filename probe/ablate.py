"""The public ablation API (the code lives in probe.ablation): zero and mean ablation, exact sweeps, fast estimates.

    from probe.ablate import ablate, sweep, estimate, head_means
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

from probe.ablation import (METHODS, METRICS, MODES, Ablation, AblationResult, Head, HeadMeans, HeadResult, ablate,
                            all_heads, estimate, head_means, label, load_results, parse_heads, read_results, sweep)
from probe.ablation.estimate import BACKWARD_COST, ESTIMATE_BUDGET, GRAD_FORWARD_COST

__all__ = ["BACKWARD_COST", "ESTIMATE_BUDGET", "GRAD_FORWARD_COST", "METHODS", "METRICS", "MODES", "Ablation",
           "AblationResult", "Head", "HeadMeans", "HeadResult", "ablate", "all_heads", "estimate", "head_means",
           "label", "load_results", "parse_heads", "read_results", "sweep", "write_csv"]


def write_csv(path: str | Path, result: AblationResult) -> Path:
    """The ablations as CSV, largest delta first, written atomically. Transitional: kept only while cli/ablate.py
    imports it; CSV output belongs to reports.files.write_csv(path, result.csv_rows())."""
    path = Path(path)
    rows = result.csv_rows()
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]) if rows else ["heads"], lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(buffer.getvalue(), encoding="utf-8")
    os.replace(tmp, path)
    return path

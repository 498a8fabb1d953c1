"""Accelerators beside the head classes: how a class's sums come from each layer call's fused statistics
(probe.kernels: the weights a backend's record rebuilds, never the n x n matrix) instead of its Score's reduce over
blocks of weights (probe.heads, which computes every class alone and knows nothing of this package).

- `registry`: `Accelerator` (what an entry provides), its declarations `Diagonal`, `Column` and `FromWeights`, and
  the registry `ACCELERATORS` by class name (`register_accelerator`).
- `classes`: the built-in classes' entries.
- `accumulate`: `FusedAccumulator`, which reads each layer call with them (the classify runner's fast path).
"""

from probe.accel import classes
from probe.accel.accumulate import FusedAccumulator
from probe.accel.registry import ACCELERATORS, Accelerator, Column, Diagonal, FromWeights, register_accelerator

__all__ = ["ACCELERATORS", "Accelerator", "Column", "Diagonal", "FromWeights", "FusedAccumulator", "classes",
           "register_accelerator"]

"""Accelerators beside the head classes: how a class's sums come from each layer call's fused statistics
(probe.kernels) instead of its Score's reduce over blocks of weights (probe.heads, which knows nothing of this
package). `registry`: `Accelerator`, `Diagonal`, `Column`, `FromWeights` and `ACCELERATORS`; `classes`: the
built-in entries; `accumulate`: `FusedAccumulator`, the classify runner's fast path.
"""

from probe.accel import classes
from probe.accel.accumulate import FusedAccumulator
from probe.accel.registry import ACCELERATORS, Accelerator, Column, Diagonal, FromWeights, register_accelerator

__all__ = ["ACCELERATORS", "Accelerator", "Column", "Diagonal", "FromWeights", "FusedAccumulator", "classes",
           "register_accelerator"]

"""Accelerators beside the head classes: a class's sums from each layer call's fused statistics (probe.kernels)
instead of its Score's reduce over blocks of weights (probe.heads knows nothing of this package)."""

from probe.accel import classes
from probe.accel.accumulate import FusedAccumulator
from probe.accel.registry import ACCELERATORS, Accelerator, Column, Diagonal, FromWeights, register_accelerator

__all__ = ["ACCELERATORS", "Accelerator", "Column", "Diagonal", "FromWeights", "FusedAccumulator", "classes",
           "register_accelerator"]

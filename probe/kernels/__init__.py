"""Fused attention, one backend per device: the seam between the hooks and the scores.

- `base`: what a backend provides (`AttentionCall`, `Backend`, `FusedStatistics`) and the registry
  (`BACKENDS`, `register_backend`, `backend_for`).
- `config`: `KernelConfig`, every tuning constant, passed in.
- `fused`: `FusedAttention`, the statistics any weight is rebuilt from, and `side_by_side`.
- `cpu`: the CPU kernel and its staged search for row maxima; `cuda`: the Triton kernel that also writes each row's
  top key; `reference`: the blocked check.
"""

from probe.kernels.base import (BACKENDS, AttentionCall, Backend, FusedStatistics, additive_bias, backend_for,
                                register_backend, using_backend)
from probe.kernels.config import DEFAULT_CONFIG, KernelConfig
from probe.kernels.cpu import CpuAttention, CpuBackend
from probe.kernels.cuda import CudaAttention, CudaBackend
from probe.kernels.fused import FusedAttention, Label, side_by_side
from probe.kernels.reference import REFERENCE, ReferenceBackend

register_backend(CpuBackend())
register_backend(CudaBackend())

__all__ = ["BACKENDS", "DEFAULT_CONFIG", "REFERENCE", "AttentionCall", "Backend", "CpuAttention", "CpuBackend",
           "CudaAttention", "CudaBackend", "FusedAttention", "FusedStatistics", "KernelConfig", "Label",
           "ReferenceBackend", "additive_bias", "backend_for", "register_backend", "side_by_side", "using_backend"]

"""Fused attention, one backend per device: the seam between the hooks and the scores.

- `base`: what a backend provides (`AttentionCall`, `Backend`, `FusedStatistics`) and the registry
  (`BACKENDS`, `register_backend`, `backend_for`).
- `config`: `KernelConfig`, every tuning constant, passed in.
- `fused`: `FusedAttention`, the statistics any weight is rebuilt from, and `side_by_side`.
- `cpu`: the CPU kernel and its staged search for row maxima; `cuda`: the Triton kernel that also writes each row's
  top key; `flex`: FlexAttention with its row maxima; `sdpa`: sdpa's flash and cuDNN kernels with their log-sum-exp,
  the Triton statistics pass for the top keys; `reference`: the blocked check.
"""

from probe.kernels.base import (BACKENDS, AttentionCall, Backend, FusedStatistics, additive_bias, backend_for,
                                register_backend, using_backend)
from probe.kernels.config import DEFAULT_CONFIG, KernelConfig
from probe.kernels.cpu import CpuAttention, CpuBackend
from probe.kernels.cuda import CudaAttention, CudaBackend
from probe.kernels.flex import FlexBackend, FlexStatistics
from probe.kernels.fused import FusedAttention, Label, side_by_side
from probe.kernels.reference import REFERENCE, ReferenceBackend
from probe.kernels.sdpa import SdpaAttention, SdpaBackend

# The order backends are asked in. For CUDA it follows bench/RESULTS.md: `python -m bench gpu` times every CUDA
# backend against a plain sdpa forward and prints which one should come first; move that line up.
register_backend(CpuBackend())
register_backend(CudaBackend())
register_backend(FlexBackend())
register_backend(SdpaBackend("flash"))
register_backend(SdpaBackend("cudnn"))

__all__ = ["BACKENDS", "DEFAULT_CONFIG", "REFERENCE", "AttentionCall", "Backend", "CpuAttention", "CpuBackend",
           "CudaAttention", "CudaBackend", "FlexBackend", "FlexStatistics", "FusedAttention", "FusedStatistics",
           "KernelConfig", "Label", "ReferenceBackend", "SdpaAttention", "SdpaBackend", "additive_bias", "backend_for",
           "register_backend", "side_by_side", "using_backend"]

"""Fused attention, one backend per device: the seam between the hooks and the scores. `base` says what a backend
provides and holds the registry; `reference` is the blocked check every backend is tested against."""

from probe.kernels.base import (BACKENDS, DEFAULT_CONFIG, AttentionCall, Backend, FusedStatistics, KernelConfig,
                                RowSearch, additive_bias, backend_for, register_backend, using_backend)
from probe.kernels.cpu import DEFAULT_SEARCH, CpuBackend, SearchConfig, StagedSearch
from probe.kernels.cuda import CudaBackend
from probe.kernels.flex import FlexBackend, MaximaSearch
from probe.kernels.fused import Label, Weights, side_by_side
from probe.kernels.reference import REFERENCE, ReferenceBackend
from probe.kernels.sdpa import SdpaBackend

# The order backends are asked in. For CUDA it follows bench/RESULTS.md: `python -m bench gpu` times every CUDA
# backend against a plain sdpa forward and prints which one should come first; move that line up.
register_backend(CpuBackend())
register_backend(CudaBackend())
register_backend(FlexBackend())
register_backend(SdpaBackend("flash"))
register_backend(SdpaBackend("cudnn"))

__all__ = ["BACKENDS", "DEFAULT_CONFIG", "DEFAULT_SEARCH", "REFERENCE", "AttentionCall", "Backend", "CpuBackend",
           "CudaBackend", "FlexBackend", "FusedStatistics", "KernelConfig", "Label", "MaximaSearch", "ReferenceBackend",
           "RowSearch", "SdpaBackend", "SearchConfig", "StagedSearch", "Weights", "additive_bias", "backend_for",
           "register_backend", "side_by_side", "using_backend"]

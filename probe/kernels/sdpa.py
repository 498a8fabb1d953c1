"""sdpa's fused kernels with their log-sum-exp (flash attention, cuDNN attention), and the Triton statistics-only pass
for each row's top key where Triton serves the call (else whole rows find a row's maximum: exact, slower).

On CUDA `aten._scaled_dot_product_flash_attention` (half precision, no mask) or
`aten._scaled_dot_product_cudnn_attention` (half precision, an additive bias); on the CPU the flash op
`aten._scaled_dot_product_flash_attention_for_cpu`, the top keys through Triton's interpreter: how it is tested
without a GPU. Head sizes are padded by zero columns to one size, a multiple of 8 (the CUDA kernels' unit).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from probe.kernels.base import (DEFAULT_CONFIG, AttentionCall, FusedStatistics, KernelConfig, float32_copy,
                                rebuild_problem, zero_padded)
from probe.kernels.cuda import CudaBackend, attention_statistics

LseKernel = Callable[[Tensor, Tensor, Tensor, Tensor | None, bool, float], tuple[Tensor, Tensor]]
"""(query, key, value, additive bias or None, causal, scale) -> (output (b, hq, n, d), log-sum-exp (b, hq, n, ...))."""

HALF = (torch.bfloat16, torch.float16)
TRITON = CudaBackend()  # asked whether its statistics pass serves a call (the top keys)


def _cpu_flash(query: Tensor, key: Tensor, value: Tensor, bias: Tensor | None, causal: bool,
               scale: float) -> tuple[Tensor, Tensor]:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal,
                                                                       attn_mask=bias, scale=scale)


def _cuda_flash(query: Tensor, key: Tensor, value: Tensor, bias: Tensor | None, causal: bool,
                scale: float) -> tuple[Tensor, Tensor]:
    assert bias is None, "the flash kernel takes no mask (SdpaBackend.problem refuses it)"
    output, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, causal, False,
                                                                         scale=scale)
    return output, lse


def _cuda_cudnn(query: Tensor, key: Tensor, value: Tensor, bias: Tensor | None, causal: bool,
                scale: float) -> tuple[Tensor, Tensor]:
    if bias is not None:
        bias = bias[(None,) * (4 - bias.dim())]  # the op takes a 4-dimensional bias (broadcast dimensions: stride 0)
    output, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(query, key, value, bias, True, 0.0, causal,
                                                                         False, scale=scale)
    return output, lse


KERNELS: dict[tuple[str, str], LseKernel] = {("flash", "cpu"): _cpu_flash, ("flash", "cuda"): _cuda_flash,
                                             ("cudnn", "cuda"): _cuda_cudnn}
"""(kernel, device type) -> its op: the CUDA ops and the CPU's flash op behind one signature."""


def _kernel_problem(kernel: str, call: AttentionCall) -> str:
    """Why `kernel` on the call's device cannot take the call ("" where it can): the CUDA kernels' constraints."""
    device = call.query.device.type
    if (kernel, device) not in KERNELS:
        return f"sdpa's {kernel} kernel with its log-sum-exp is not wired for {device}"
    if device != "cuda":
        return ""
    if call.query.dtype not in HALF or call.key.dtype != call.query.dtype or call.value.dtype != call.query.dtype:
        return f"queries, keys and values of {call.query.dtype} (the {kernel} kernel takes bfloat16 or float16)"
    if torch.cuda.get_device_capability(call.query.device) < (8, 0):
        return f"the {kernel} kernel needs compute capability 8.0 or later"
    widest = _padded_size(max(call.query.shape[-1], call.value.shape[-1]))
    if kernel == "flash":
        if not torch.backends.cuda.is_flash_attention_available():
            return "this torch was built without the flash attention kernel"
        if call.bias is not None or call.structured:
            return "a mask or bias (the flash kernel takes causal masks only)"
        return "head size over 256" if widest > 256 else ""
    if not torch.backends.cudnn.is_available():
        return "cuDNN is not available"
    return "head size over 128 (cuDNN attention)" if widest > 128 else ""


class SdpaBackend:
    """sdpa's `kernel` ("flash" or "cudnn") for the output and log-sum-exp, the Triton pass for the top keys."""

    def __init__(self, kernel: str) -> None:
        if kernel not in ("flash", "cudnn"):
            raise ValueError(f"kernel is 'flash' or 'cudnn', got {kernel!r}")
        self.kernel = kernel
        self.name = f"sdpa-{kernel}"

    def problem(self, call: AttentionCall) -> str:
        """"" where the kernel serves the call, else why not. Reads shapes, dtypes and devices only."""
        return rebuild_problem(call) or _kernel_problem(self.kernel, call)

    def run(self, call: AttentionCall, config: KernelConfig = DEFAULT_CONFIG) -> tuple[Tensor, FusedStatistics]:
        """(output (b, n, hq, dv), statistics with the log-sum-exp and, where Triton serves, the top keys)."""
        call = call.with_dense_bias()
        kernel = KERNELS[self.kernel, call.query.device.type]
        output, lse = lse_forward(call, kernel, _padded_size(max(call.query.shape[-1], call.value.shape[-1])))
        statistics = FusedStatistics(self.name, float32_copy(call.query), float32_copy(call.key), lse, call.scaling,
                                     call.causal and call.bias is None, call.bias, top_keys=top_keys(call),
                                     config=config)
        return output, statistics


def lse_forward(call: AttentionCall, kernel: LseKernel, size: int) -> tuple[Tensor, Tensor]:
    """(output (b, n, hq, dv), log-sum-exp (b, hq, n) float32) of an op that returns both, for a call whose mask is
    a bias already (AttentionCall.with_dense_bias), its heads zero-padded to `size`."""
    b, hq, n, _ = call.query.shape
    query, key, value = (zero_padded(tensor, size) for tensor in (call.query, call.key, call.value))
    output, lse = kernel(query, key, value, call.bias, call.causal and call.bias is None, call.scaling)
    return output[..., :call.value.shape[-1]].transpose(1, 2).contiguous(), lse[:, :, :n].reshape(b, hq, n).float()


def top_keys(call: AttentionCall) -> Tensor | None:
    """(b, hq, n) int32: each row's top key from the Triton statistics pass where it serves the call, else None."""
    if TRITON.problem(call):
        return None
    return attention_statistics(call.query, call.key, call.bias, call.scaling, call.causal and call.bias is None)[1]


def _padded_size(size: int) -> int:
    return -(-size // 8) * 8

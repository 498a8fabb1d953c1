"""The CUDA backend: one Triton flash-attention forward that writes, in a single pass over the keys, the output, each
query row's log-sum-exp (float32) and the index of its largest logit (the earliest on ties, a NaN counting as the
largest, as argmax says on the CPU). The scores then read every diagonal and column from the log-sum-exp and every
row's top key from the indices (`FusedAttention.top_keys`): nothing of the n x n weights, no search, and no value
read back to the host.

The kernel is a flash-attention forward (Dao et al. 2022, "FlashAttention"; Triton's fused-attention tutorial): a
program holds one block of query rows of one query head, walks the blocks of keys of that head's key/value head
(grouped- and multi-query heads read the shared keys where they are: never repeated in memory), keeps each row's
running maximum and sum of exponentials, and rescales its output accumulator when the maximum grows. Beside the
running maximum it keeps the running top key: the maximum among NaN-free logits with its earliest index, and the
earliest NaN. Masks are the call's additive bias (padding, sliding windows, ALiBi: a boolean mask made additive by
the hooks) read with broadcast strides, or plain causal, computed from indices. Head sizes are padded to a power of
two (at least 16) inside the kernel; the value head has a size of its own (multi-head latent attention).

Runs on CUDA tensors; with `TRITON_INTERPRET=1` set (Triton's interpreter, tests on a machine without a GPU) it also
serves CPU tensors, slowly. Soft-capping stays refused (`rebuild_problem`): a weight rebuilt as
exp(logit - lse) from the uncapped logit would not be the capped weight.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from probe.kernels.base import AttentionCall, rebuild_problem
from probe.kernels.config import DEFAULT_CONFIG, KernelConfig
from probe.kernels.fused import FusedAttention
from probe.kernels.labels import label_weights

triton: Any = None  # imported on the kernel's first use (_jitted): Triton reads TRITON_INTERPRET when it is imported
tl: Any = None

NAME = "cuda"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256
NO_NAN = 2**30  # "no NaN seen yet": larger than any key index the kernel is given (passed in as a constexpr)


def interpreted() -> bool:
    """Whether Triton's interpreter is on (TRITON_INTERPRET=1): kernels then run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class CudaBackend:
    """The Triton kernel: CUDA tensors of float32, bfloat16 or float16, head sizes up to 256, any mask the hooks
    make additive. CPU tensors too where TRITON_INTERPRET=1 is set (Triton's interpreter: tests without a GPU).
    `output`: "kernel" (the default) takes the layer's output from the kernel, one pass for output and statistics;
    "sdpa" keeps torch's own attention for the output and runs the kernel for the statistics alone, without the
    value product (`python -m bench gpu` times both against sdpa)."""

    name = NAME

    def __init__(self, output: str = "kernel") -> None:
        if output not in ("kernel", "sdpa"):
            raise ValueError(f"output is 'kernel' or 'sdpa', got {output!r}")
        self.output = output

    def problem(self, call: AttentionCall) -> str:
        """"" where the kernel serves the call, else why not: CUDA tensors, and CPU tensors only where
        TRITON_INTERPRET=1 is set (Triton's interpreter, for tests). Reads only shapes, dtypes and devices: no sync."""
        shared = rebuild_problem(call)
        if shared:
            return shared
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install triton)"
        device = call.query.device.type
        if device != "cuda" and not (device == "cpu" and interpreted()):
            return f"the Triton kernel runs on cuda, not {device} (CPU tensors only with TRITON_INTERPRET=1)"
        if call.query.dtype not in DTYPES or call.key.dtype != call.query.dtype or \
                call.value.dtype != call.query.dtype:
            return f"queries, keys and values of {call.query.dtype} (the kernel takes float32, bfloat16, float16)"
        if max(call.query.shape[-1], call.value.shape[-1]) > MAX_HEAD_DIM:
            return f"head size over {MAX_HEAD_DIM}"
        if call.bias is not None and call.bias.dim() > 4:
            return "a bias of more than 4 dimensions"
        return ""

    def run(self, call: AttentionCall, config: KernelConfig = DEFAULT_CONFIG) -> tuple[Tensor, CudaAttention]:
        """(output (b, n, hq, dv) in the value's dtype, statistics with the float32 log-sum-exp and each row's top
        key index); causal applies only without a bias."""
        plain_causal = call.causal and call.bias is None
        if self.output == "sdpa":
            lse, top = attention_statistics(call.query, call.key, call.bias, call.scaling, plain_causal)
            output = torch.nn.functional.scaled_dot_product_attention(
                call.query, call.key, call.value, attn_mask=call.bias, is_causal=plain_causal, scale=call.scaling,
                enable_gqa=call.query.shape[1] != call.key.shape[1]).transpose(1, 2).contiguous()
        else:
            output, lse, top = attention_forward(call.query, call.key, call.value, call.bias, call.scaling,
                                                 plain_causal)
        return output, CudaAttention(call.query, call.key, call.bias, call.scaling, plain_causal, lse, config,
                                     top_keys=top)


@dataclass
class CudaAttention(FusedAttention):
    """FusedAttention with the kernel's top key of every row (`top_keys`): row maxima (positional's question) are
    read from it on the device (FusedAttention.neighbour_hits / tops_of_rows), never searched. Queries and keys stay
    in the model's dtype (`whole_copies` False: a float32 copy of both per layer would cost what the kernel costs in
    memory traffic); the diagonals and columns the scores read come from one launch over every row
    (probe.kernels.labels), which makes each value it loads float32."""

    backend = NAME
    whole_copies = False

    def _in_chunks(self, offsets: tuple[int, ...], keys: tuple[int, ...]) -> Tensor:
        """(b, hq, n, len(offsets) + len(keys)): FusedAttention's table of the weights on keys i + offset and on
        `keys`, from one launch of the label kernel over every row (no row chunks, no gathered keys)."""
        return label_weights(self.query, self.key, self.bias, self.lse, self.scaling, self.causal, offsets, keys,
                             interpreted())


@dataclass(frozen=True)
class Blocks:
    """How the kernel tiles one call: query rows per program, keys per step, padded head sizes, warps."""

    rows: int
    keys: int
    head: int
    value_head: int
    warps: int


def blocks_for(d: int, dv: int, interpreter: bool) -> Blocks:
    """The tiling of a call: head sizes padded to a power of two (tl.dot needs 16 at least); 128 x 64 tiles for
    heads up to 64 wide, 64 x 64 to 128, 64 x 32 above (shared memory holds a query block and a key and value
    block); the interpreter takes 32 x 32 (numpy's cost is per step, small tiles waste nothing there)."""
    head, value_head = (max(16, 1 << (size - 1).bit_length()) for size in (d, dv))
    widest = max(head, value_head)
    if interpreter:
        return Blocks(32, 32, head, value_head, 4)
    if widest <= 64:
        return Blocks(128, 64, head, value_head, 4)
    return Blocks(64, 64 if widest <= 128 else 32, head, value_head, 4 if widest <= 128 else 8)


def attention_forward(query: Tensor, key: Tensor, value: Tensor, bias: Tensor | None, scaling: float,
                      causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(output (b, n, hq, dv) in the value's dtype, log-sum-exp (b, hq, n) float32, top key (b, hq, n) int32) of
    query (b, hq, n, d), key (b, hk, kv, d), value (b, hk, kv, dv) and an additive bias broadcastable to
    (b, hq, n, kv) or None (then `causal` hides keys j > i + kv - n). One kernel launch, no host synchronisation."""
    b, hq, n, _ = query.shape
    output = value.new_empty(b, n, hq, value.shape[-1])
    return (output, *_launch(query, key, value, output, bias, scaling, causal))


def attention_statistics(query: Tensor, key: Tensor, bias: Tensor | None, scaling: float,
                         causal: bool) -> tuple[Tensor, Tensor]:
    """attention_forward's log-sum-exp and top keys alone: the same pass without values or the value product."""
    return _launch(query, key, None, None, bias, scaling, causal)


def _launch(query: Tensor, key: Tensor, value: Tensor | None, output: Tensor | None, bias: Tensor | None,
            scaling: float, causal: bool) -> tuple[Tensor, Tensor]:
    """One launch of the kernel: its log-sum-exp and top keys, the output written where `output` is given."""
    b, hq, n, d = query.shape
    hk, kv = key.shape[1], key.shape[2]
    dv = value.shape[-1] if value is not None else 1
    lse = torch.empty(b, hq, n, dtype=torch.float32, device=query.device)
    top = torch.empty(b, hq, n, dtype=torch.int32, device=query.device)
    if bias is not None:
        bias = bias[(None,) * (4 - bias.dim())].expand(b, hq, n, kv)  # broadcast dimensions: stride 0
    interpreter = interpreted()  # on any device's tensors (it copies them to the host): its own tiles and dots
    blocks = blocks_for(d, dv, interpreter)
    grid = (-(-n // blocks.rows), b * hq)
    none = (0, 0, 0, 0)
    _kernel()[grid](
        query, key, value if value is not None else key, bias if bias is not None else query,
        output if output is not None else query, lse, top, *query.stride(), *key.stride(),
        *(value.stride() if value is not None else none), *(bias.stride() if bias is not None else none),
        *(output.stride() if output is not None else none), n, kv, hq, hq // hk, d, dv, scaling,
        NONE=NO_NAN, HAS_BIAS=bias is not None, CAUSAL=causal, WITH_OUTPUT=output is not None,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        UPCAST=query.dtype == torch.bfloat16 and interpreter, BLOCK_M=blocks.rows,
        BLOCK_N=blocks.keys, HEAD=blocks.head, VALUE_HEAD=blocks.value_head, num_warps=blocks.warps)
    return lse, top


@functools.lru_cache(maxsize=2)
def _jitted(interpret: bool) -> Any:
    """The kernel, compiled by Triton (or wrapped by its interpreter). Triton is imported here, not with probe:
    whether it interprets is fixed when it is imported (its own helpers, tl.sum and the like, are decorated then),
    so a test sets TRITON_INTERPRET before the first call, not before importing probe."""
    del interpret  # the cache key: one decoration per mode
    global triton, tl
    triton, tl = importlib.import_module("triton"), importlib.import_module("triton.language")
    return triton.jit(_attention_rows)


def _kernel() -> Any:
    return _jitted(interpreted())


def _attention_rows(Q, K, V, B, Out, Lse, Top, sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                    sbb, sbh, sbn, sbk, sob, son, soh, sod, n, kv, hq, group, d, dv, scaling, NONE: tl.constexpr,
                    HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, WITH_OUTPUT: tl.constexpr,
                    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD: tl.constexpr, VALUE_HEAD: tl.constexpr):
    """One block of BLOCK_M query rows of one (sequence, query head): its log-sum-exp, top keys and (WITH_OUTPUT)
    output rows. PRECISION "ieee": float32 products, not TF32. UPCAST: bfloat16 dots in float32 (the interpreter's
    dot misreads bfloat16). tl.reduce with Triton's combine functions, not tl.max: the interpreter serves those even
    where Triton was imported without it (tl.max is then a compiled helper it cannot call)."""
    sequence, head = (tl.program_id(1) // hq).to(tl.int64), tl.program_id(1) % hq  # offsets past 2^31: int64
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims, value_dims = tl.arange(0, HEAD), tl.arange(0, VALUE_HEAD)
    q = tl.load(Q + sequence * sqb + head * sqh + rows[:, None] * sqn + dims[None, :] * sqd,
                mask=(rows[:, None] < n) & (dims[None, :] < d), other=0.0)
    q = q.to(tl.float32) if UPCAST else q
    k_base, v_base = K + sequence * skb + head // group * skh, V + sequence * svb + head // group * svh  # shared
    # per row: the running maximum of the NaN-free logits, the sum of exp(logit - maximum), the output accumulator,
    maximum, total = tl.full([BLOCK_M], float("-inf"), tl.float32), tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, VALUE_HEAD], 0.0, tl.float32)  # and the earliest key holding the maximum and NaN
    top, first_nan = tl.full([BLOCK_M], 0, tl.int32), tl.full([BLOCK_M], NONE, tl.int32)
    end = tl.minimum(kv, (tl.program_id(0) + 1) * BLOCK_M + kv - n) if CAUSAL else kv  # the last key any row sees
    for start in range(0, end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        k = tl.load(k_base + keys[None, :] * skn + dims[:, None] * skd,
                    mask=(keys[None, :] < kv) & (dims[:, None] < d), other=0.0)  # (HEAD, BLOCK_N)
        logits = tl.dot(q, k.to(tl.float32) if UPCAST else k, input_precision=PRECISION) * scaling
        visible = (rows[:, None] < n) & (keys[None, :] < kv)
        if HAS_BIAS:
            bias = tl.load(B + sequence * sbb + head * sbh + rows[:, None].to(tl.int64) * sbn + keys[None, :] * sbk,
                           mask=visible, other=float("-inf"))
            logits = logits + bias.to(tl.float32)
        if CAUSAL:
            visible = visible & (keys[None, :] <= rows[:, None] + kv - n)
        logits = tl.where(visible, logits, float("-inf"))
        is_nan = logits != logits
        first_nan = tl.minimum(first_nan, tl.reduce(tl.where(is_nan, keys[None, :], NONE), 1,
                                                    tl.standard._elementwise_min))
        clean = tl.where(is_nan, float("-inf"), logits)
        block_max = tl.reduce(clean, 1, tl.standard._elementwise_max)  # top: the block's earliest key at its max,
        top = tl.where(block_max > maximum, tl.reduce(tl.where(clean == block_max[:, None], keys[None, :], NONE), 1,
                                                      tl.standard._elementwise_min), top)  # if larger (ties: earlier)
        grown = tl.maximum(maximum, block_max)
        shift = tl.where(grown == float("-inf"), 0.0, grown)  # rows with no visible key yet: exp(-inf) = 0
        weights = tl.exp(clean - shift[:, None])
        rescale = tl.exp(maximum - shift)
        total = total * rescale + tl.reduce(weights, 1, tl.standard._sum_combine)
        if WITH_OUTPUT:
            v = tl.load(v_base + keys[:, None] * svn + value_dims[None, :] * svd,
                        mask=(keys[:, None] < kv) & (value_dims[None, :] < dv), other=0.0)  # (BLOCK_N, VALUE_HEAD)
            v = v.to(tl.float32) if UPCAST else v
            acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION)
        maximum = grown
    nan_row = first_nan < NONE  # a NaN logit: the row's weights, output and log-sum-exp are NaN, as softmax's
    if WITH_OUTPUT:
        tl.store(Out + sequence * sob + rows[:, None] * son + head * soh + value_dims[None, :] * sod,
                 tl.where(nan_row[:, None], float("nan"), acc / total[:, None]).to(Out.dtype.element_ty),
                 mask=(rows[:, None] < n) & (value_dims[None, :] < dv))
    tl.store(Lse + (sequence * hq + head) * n + rows, tl.where(nan_row, float("nan"), maximum + tl.log(total)),
             mask=rows < n)
    tl.store(Top + (sequence * hq + head) * n + rows, tl.where(nan_row, first_nan, top), mask=rows < n)

"""The CUDA backend: one Triton flash-attention forward (Dao et al. 2022; Triton's fused-attention tutorial) that
writes, in one pass over the keys, the output, each row's float32 log-sum-exp and the index of its largest logit (the
earliest on ties, a NaN the largest, as argmax says). The scores read every weight from the log-sum-exp and every
row's top key from the indices (`top_keys`): no search, nothing read back to the host. Where asked
(`KernelConfig.moments`) the same pass accumulates each row's moments (probe.kernels.moments).

A program holds a block of query rows of one query head and walks its key/value head's keys in place (grouped heads
never repeated). Key mask, window and causal flag are computed from indices: blocks every row sees whole run
unmasked, as the tutorial splits its causal loop; any other mask is an additive bias read with broadcast strides.
Logits are in base 2 (the scale times log2(e)), so every exponential is an exp2. Tiles are autotuned among `TILES`,
each compiled for sm_80 and sm_90 without spills (tests/test_kernel_compile.py). With `TRITON_INTERPRET=1` it also
serves CPU tensors, slowly (tests without a GPU). A second kernel (`label_weights`) rebuilds the diagonals and
columns the scores read, the record's `tables`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from probe.kernels.base import (DEFAULT_CONFIG, AttentionCall, FusedStatistics, KernelConfig, broadcast_bias,
                                interpreted, padded, rebuild_problem, triton_problem)
from probe.kernels.fused import uploaded

triton: Any = None  # imported on the kernel's first use (_kernels): Triton reads TRITON_INTERPRET when it is imported
tl: Any = None
_largest: Any = None  # tl.max and tl.sum: set in each mode's namespace of the kernel (_kernels)
_total: Any = None

NAME = "cuda"
NO_NAN = 2**30  # "no NaN seen yet": larger than any key index the kernel is given (passed in as a constexpr)
LOG2E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)): the kernel's logits are the scaled ones times this


class CudaBackend:
    """The Triton kernel. `output`: "kernel" takes the layer's output from the kernel's one pass; "sdpa" keeps torch's
    attention for the output and runs the kernel for the statistics alone (not registered: `python -m bench gpu`
    times what is)."""

    name = NAME

    def __init__(self, output: str = "kernel") -> None:
        if output not in ("kernel", "sdpa"):
            raise ValueError(f"output is 'kernel' or 'sdpa', got {output!r}")
        self.output = output

    def problem(self, call: AttentionCall) -> str:
        """"" where the kernel serves the call, else why not. Reads only shapes, dtypes and devices: no sync."""
        if shared := rebuild_problem(call):
            return shared
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install triton)"
        device = call.query.device.type
        if device != "cuda" and not (device == "cpu" and interpreted()):
            return f"the Triton kernel runs on cuda, not {device} (CPU tensors only with TRITON_INTERPRET=1)"
        return triton_problem(call, "the kernel")

    def run(self, call: AttentionCall, config: KernelConfig = DEFAULT_CONFIG) -> tuple[Tensor, FusedStatistics]:
        """(output (b, n, hq, dv), statistics with the log-sum-exp and top keys); the key mask and window are read as
        they are (no dense bias, but for `output="sdpa"`, whose output torch computes from one)."""
        causal = call.causal and call.bias is None  # the kernel's flag: with a key mask and window, or plain
        b, hq, n, _ = call.query.shape
        moments = torch.empty(b, hq, n, 4, dtype=torch.float32, device=call.query.device) if config.moments else None
        if self.output == "sdpa":
            # sdpa hands back neither its log-sum-exp nor its logits: the statistics-only pass is q k^T once more
            lse, top = attention_statistics(call.query, call.key, call.bias, call.scaling, causal,
                                            key_mask=call.key_mask, window=call.window, moments=moments)
            dense = call.with_dense_bias()
            output = torch.nn.functional.scaled_dot_product_attention(
                call.query, call.key, call.value, attn_mask=dense.bias, is_causal=dense.causal and dense.bias is None,
                scale=call.scaling, enable_gqa=call.query.shape[1] != call.key.shape[1]).transpose(1, 2).contiguous()
        else:
            output = call.value.new_empty(b, n, hq, call.value.shape[-1])
            lse, top = _launch(call.query, call.key, call.value, output, call.scaling, call.bias, call.key_mask,
                               call.window, causal, moments)
        # queries and keys stay in the model's dtype: float32 copies would cost what the kernel costs in traffic
        return output, FusedStatistics(NAME, call.query, call.key, lse, call.scaling, causal, call.bias,
                                       call.key_mask, call.window, top_keys=top, tables=label_weights, config=config,
                                       moments=moments)


@dataclass(frozen=True)
class Tile:
    """One configuration autotune may pick: query rows per program, keys per step, warps, pipeline stages."""

    rows: int
    keys: int
    warps: int
    stages: int


TILES: dict[tuple[int, str, bool], tuple[Tile, ...]] = {
    # (the wider padded head, "half" or "float32", with the output) -> the tiles autotune times. Half precision: the
    # tutorial's shapes, narrowed to 32 keys per step where the accumulator, the top key and the masks would spill;
    # float32: exact IEEE products, small tiles. Registers and spills of each: bench/RESULTS.md.
    (64, "half", True): (Tile(128, 32, 4, 3), Tile(64, 64, 4, 3)),
    (128, "half", True): (Tile(128, 32, 8, 3), Tile(64, 32, 8, 3)),
    (256, "half", True): (Tile(32, 32, 8, 2),),
    (64, "half", False): (Tile(128, 64, 4, 3), Tile(128, 128, 8, 3)),
    (128, "half", False): (Tile(128, 64, 8, 3), Tile(128, 128, 8, 3)),
    (256, "half", False): (Tile(128, 64, 8, 2), Tile(64, 64, 4, 3)),
    (64, "float32", True): (Tile(32, 32, 4, 2),),
    (128, "float32", True): (Tile(16, 32, 4, 2),),
    (256, "float32", True): (Tile(16, 16, 4, 1),),
    (64, "float32", False): (Tile(32, 32, 4, 2),),
    (128, "float32", False): (Tile(16, 32, 4, 2),),
    (256, "float32", False): (Tile(16, 16, 4, 2),),
}
INTERPRETER_TILE = Tile(32, 32, 4, 1)  # numpy's cost is per step: small tiles waste nothing there


def tiles_for(head: int, value_head: int, dtype: torch.dtype, with_output: bool) -> tuple[Tile, ...]:
    """The tiles autotune chooses among for padded head sizes, a dtype and whether the output is written."""
    widest = max(head, value_head if with_output else 16)
    size = 64 if widest <= 64 else 128 if widest <= 128 else 256
    return TILES[size, "float32" if dtype == torch.float32 else "half", with_output]


def attention_statistics(query: Tensor, key: Tensor, bias: Tensor | None, scaling: float, causal: bool, *,
                         key_mask: Tensor | None = None, window: int | None = None,
                         moments: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(log-sum-exp (b, hq, n) float32, top key (b, hq, n) int32): the kernel's pass without values. The mask: an
    additive bias, or key mask (b, kv), window and `causal`; `moments`, where given, filled in the same pass."""
    return _launch(query, key, None, None, scaling, bias, key_mask, window, causal, moments)


def _launch(query: Tensor, key: Tensor, value: Tensor | None, output: Tensor | None, scaling: float,
            bias: Tensor | None, key_mask: Tensor | None, window: int | None, causal: bool,
            moments: Tensor | None) -> tuple[Tensor, Tensor]:
    """One launch, no host synchronisation: log-sum-exp and top keys, the output (b, n, hq, dv) where given."""
    b, hq, n, d = query.shape
    hk, kv = key.shape[1], key.shape[2]
    dv = value.shape[-1] if value is not None else 1
    lse = torch.empty(b, hq, n, dtype=torch.float32, device=query.device)
    top = torch.empty(b, hq, n, dtype=torch.int32, device=query.device)
    if bias is not None:
        bias = broadcast_bias(bias, (b, hq, n, kv))
    interpreter = interpreted()  # on any device's tensors (it copies them to the host): its own tiles and dots
    none = (0, 0, 0, 0)
    arguments = (
        query, key, value if value is not None else key, bias if bias is not None else query,
        key_mask if key_mask is not None else lse, output if output is not None else query, lse, top,
        moments if moments is not None else lse,
        *query.stride(), *key.stride(), *(value.stride() if value is not None else none),
        *(bias.stride() if bias is not None else none), *(key_mask.stride() if key_mask is not None else (0, 0)),
        *(output.stride() if output is not None else none),
        n, kv, hq, hq // hk, window or 0, scaling * LOG2E,
        min(max(padded(kv), 256), 65536))  # autotune's length class: a power of two of keys (one timing per class)
    constants = dict(D=d, DV=dv, HEAD=padded(d), VALUE_HEAD=padded(dv), NONE=NO_NAN, HAS_BIAS=bias is not None,
                     HAS_KEY_MASK=key_mask is not None, WINDOWED=window is not None, CAUSAL=causal,
                     WITH_OUTPUT=output is not None, MOMENTS=moments is not None,
                     PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
                     UPCAST=query.dtype == torch.bfloat16 and interpreter)
    kernel = _kernels(interpreter).launch
    if interpreter:
        tile = INTERPRETER_TILE
        kernel[(-(-n // tile.rows), b * hq)](*arguments, **constants, BLOCK_M=tile.rows, BLOCK_N=tile.keys,
                                             num_warps=tile.warps)
    else:
        kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_M"]), b * hq)](*arguments, **constants)
    return lse, top


@dataclass(frozen=True)
class Kernels:
    """The kernel of one mode: `launch` (autotuned when compiled) and `jitted`, the function Triton compiles."""

    launch: Any
    jitted: Any


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool) -> Kernels:
    """The kernel, compiled by Triton (autotuned over TILES) or wrapped by its interpreter. Triton is imported here:
    whether it interprets is fixed when it is decorated. Each mode gets its own copy of the kernel's functions and
    Triton's reductions (decorated for the compiler where Triton was imported before it was asked to interpret)."""
    global triton, tl
    triton, tl = importlib.import_module("triton"), importlib.import_module("triton.language")
    namespace: dict[str, Any] = {"__name__": __name__, "tl": tl, "triton": triton}
    for name, reduction in (("_largest", tl.max), ("_total", tl.sum)):
        namespace[name] = triton.jit(reduction.fn) if interpret else reduction

    def jitted(function: Any) -> Any:
        return triton.jit(types.FunctionType(function.__code__, namespace, function.__name__))

    for helper in (_tile, _walk_keys, _moments, _store_moments):
        namespace[helper.__name__] = jitted(helper)
    kernel = jitted(_attention_rows)
    if interpret:
        return Kernels(kernel, kernel)
    tiles = dict.fromkeys(tile for choices in TILES.values() for tile in choices)
    configs = [triton.Config({"BLOCK_M": tile.rows, "BLOCK_N": tile.keys}, num_warps=tile.warps,
                             num_stages=tile.stages) for tile in tiles]
    tuned = triton.autotune(configs, key=["HEAD", "VALUE_HEAD", "CAUSAL", "WITH_OUTPUT", "MOMENTS", "length_class"],
                            prune_configs_by={"early_config_prune": _configs_for_call})(kernel)
    return Kernels(tuned, kernel)


def _configs_for_call(configs: list[Any], named_args: dict[str, Any], **constants: Any) -> list[Any]:
    """autotune's pruning: the configurations of TILES for this call's head sizes, dtype and output."""
    wanted = tiles_for(constants["HEAD"], constants["VALUE_HEAD"], named_args["Q"].dtype, constants["WITH_OUTPUT"])
    return [config for config in configs
            if Tile(config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages)
            in wanted]


def _attention_rows(Q, K, V, Bias, KeyMask, Out, Lse, Top, Moments, sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh,
                    svn, svd, sbb, sbh, sbn, sbk, smb, smk, sob, son, soh, sod, n, kv, hq, group, window, qk_scale,
                    length_class, D: tl.constexpr, DV: tl.constexpr, HEAD: tl.constexpr, VALUE_HEAD: tl.constexpr,
                    NONE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_KEY_MASK: tl.constexpr, WINDOWED: tl.constexpr,
                    CAUSAL: tl.constexpr, WITH_OUTPUT: tl.constexpr, MOMENTS: tl.constexpr, PRECISION: tl.constexpr,
                    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One block of BLOCK_M query rows of one (sequence, query head): its log-sum-exp, top keys, (WITH_OUTPUT)
    output rows and (MOMENTS) moments. HEAD, VALUE_HEAD: D and DV padded to a power of two. qk_scale: the scaling
    times log2(e). UPCAST: bfloat16 dots in float32 (the interpreter's dot misreads bfloat16)."""
    sequence, head = (tl.program_id(1) // hq).to(tl.int64), tl.program_id(1) % hq  # offsets past 2^31: int64
    first = tl.program_id(0) * BLOCK_M
    rows = first + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    dims = tl.arange(0, HEAD)
    q = tl.load(Q + sequence * sqb + head * sqh + rows[:, None] * sqn + dims[None, :] * sqd,
                mask=(rows[:, None] < n) & (dims[None, :] < D), other=0.0)  # (BLOCK_M, HEAD)
    q = q.to(tl.float32) if UPCAST else q
    keys_at = K + sequence * skb + head // group * skh  # grouped query heads read their key/value head in place
    values_at = V + sequence * svb + head // group * svh
    bias_at = Bias + sequence * sbb + head * sbh + rows[:, None].to(tl.int64) * sbn  # (BLOCK_M, 1)
    mask_at = KeyMask + sequence * smb
    # per row: the running maximum of the NaN-free logits, the sum of exp2(logit - maximum), the output
    # accumulator, the earliest key holding the maximum, the earliest NaN
    maximum, total = tl.full([BLOCK_M], float("-inf"), tl.float32), tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, VALUE_HEAD], tl.float32)
    top, first_nan = tl.zeros([BLOCK_M], tl.int32), tl.full([BLOCK_M], NONE, tl.int32)
    # the keys, in order: [start, body) masked (the window's edge), [body, body_end) seen whole by every row,
    # [body_end, stop) masked (the diagonal and the last keys); query i is key i + kv - n
    stop = tl.minimum(kv, first + BLOCK_M + kv - n) if CAUSAL else kv
    start, body = 0, 0
    if WINDOWED:  # keys past every row's window start at its last row's
        start = tl.maximum(first + kv - n - window + 1, 0) // BLOCK_N * BLOCK_N
        body = tl.minimum((tl.maximum(first + BLOCK_M + kv - n - window, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N,
                          stop)
    whole = kv // BLOCK_N * BLOCK_N
    if CAUSAL:  # keys up to the first row's own
        whole = tl.minimum(whole, (first + kv - n + 1) // BLOCK_N * BLOCK_N)
    body_end = tl.maximum(body, whole)
    state = (maximum, total, acc, top, first_nan, (total, total, total, maximum))  # moments: 3 sums, a maximum
    where = (keys_at, values_at, bias_at, mask_at, skn, skd, svn, svd, sbk, smk)
    sizes = (rows, n, kv, window, qk_scale)
    state = _walk_keys(q, state, where, sizes, start, body, D, DV, HEAD, VALUE_HEAD, NONE, HAS_BIAS, HAS_KEY_MASK,
                       WINDOWED, CAUSAL, WITH_OUTPUT, MOMENTS, PRECISION, UPCAST, BLOCK_N, True)
    state = _walk_keys(q, state, where, sizes, body, body_end, D, DV, HEAD, VALUE_HEAD, NONE, HAS_BIAS,
                       HAS_KEY_MASK, WINDOWED, CAUSAL, WITH_OUTPUT, MOMENTS, PRECISION, UPCAST, BLOCK_N, False)
    maximum, total, acc, top, first_nan, moments = _walk_keys(
        q, state, where, sizes, body_end, stop, D, DV, HEAD, VALUE_HEAD, NONE, HAS_BIAS, HAS_KEY_MASK, WINDOWED,
        CAUSAL, WITH_OUTPUT, MOMENTS, PRECISION, UPCAST, BLOCK_N, True)
    nan_row = first_nan < NONE  # a NaN logit: the row's weights, output and log-sum-exp are NaN, as softmax's
    if WITH_OUTPUT:
        value_dims = tl.arange(0, VALUE_HEAD)
        tl.store(Out + sequence * sob + rows[:, None] * son + head * soh + value_dims[None, :] * sod,
                 tl.where(nan_row[:, None], float("nan"), acc / total[:, None]).to(Out.dtype.element_ty),
                 mask=(rows[:, None] < n) & (value_dims[None, :] < DV))
    lse = (maximum + tl.math.log2(total)) * 0.6931471805599453  # base 2 back to natural: times ln(2)
    tl.store(Lse + (sequence * hq + head) * n + rows, tl.where(nan_row, float("nan"), lse), mask=rows < n)
    tl.store(Top + (sequence * hq + head) * n + rows, tl.where(nan_row, first_nan, top), mask=rows < n)
    _store_moments(Moments + ((sequence * hq + head) * n + rows) * 4, moments, total, rows < n, MOMENTS)


def _walk_keys(q, state, where, sizes, start, stop, D: tl.constexpr, DV: tl.constexpr, HEAD: tl.constexpr,
               VALUE_HEAD: tl.constexpr, NONE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
               WINDOWED: tl.constexpr, CAUSAL: tl.constexpr, WITH_OUTPUT: tl.constexpr, MOMENTS: tl.constexpr,
               PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """Keys start .. stop, BLOCK_N at a time, into the rows' running state. MASKED: blocks where some row must not see
    some key (past kv, after its own, before its window). Keys come in order, so a tie keeps the earlier top key."""
    maximum, total, acc, top, first_nan, moments = state
    keys_at, values_at, bias_at, mask_at, skn, skd, svn, svd, sbk, smk = where
    rows, n, kv, window, qk_scale = sizes
    dims, value_dims = tl.arange(0, HEAD), tl.arange(0, VALUE_HEAD)
    for begin in range(start, stop, BLOCK_N):
        keys = begin + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        k = _tile(keys_at, keys, dims, skn, skd, kv, D, HEAD, MASKED)  # (BLOCK_N, HEAD)
        k = k.to(tl.float32) if UPCAST else k
        logits = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), base 2
        if HAS_BIAS:
            bias = tl.load(bias_at + keys[None, :] * sbk, mask=(rows[:, None] < n) & (keys[None, :] < kv),
                           other=float("-inf"))
            logits = logits + bias.to(tl.float32) * 1.4426950408889634  # log2(e)
        if HAS_KEY_MASK:
            attends = tl.load(mask_at + keys * smk, mask=keys < kv, other=0) != 0  # (BLOCK_N,)
            logits = tl.where(attends[None, :], logits, float("-inf"))
        if MASKED:
            own = rows[:, None] + kv - n  # (BLOCK_M, 1): each query's own key
            seen = keys[None, :] < kv
            if CAUSAL:
                seen = seen & (keys[None, :] <= own)
            if WINDOWED:
                seen = seen & (keys[None, :] > own - window)
            logits = tl.where(seen, logits, float("-inf"))
        is_nan = logits != logits  # the earliest NaN: the first block with one holds it, at its first
        nan_seen, nan_at = _largest(is_nan.to(tl.int32), 1, return_indices=True, return_indices_tie_break_left=True)
        first_nan = tl.where((first_nan == NONE) & (nan_seen > 0), begin + nan_at, first_nan)
        clean = tl.where(is_nan, float("-inf"), logits)  # the block's earliest key at its maximum: the top if larger
        block_max, at = _largest(clean, 1, return_indices=True, return_indices_tie_break_left=True)
        top = tl.where(block_max > maximum, begin + at, top)
        grown = tl.maximum(maximum, block_max)
        shift = tl.where(grown == float("-inf"), 0.0, grown)  # rows with no visible key yet: exp2(-inf) = 0
        weights = tl.math.exp2(clean - shift[:, None])
        rescale = tl.math.exp2(maximum - shift)
        total = total * rescale + _total(weights, 1)
        if WITH_OUTPUT:
            v = _tile(values_at, keys, value_dims, svn, svd, kv, DV, VALUE_HEAD, MASKED)  # (BLOCK_N, VALUE_HEAD)
            v = v.to(tl.float32) if UPCAST else v
            acc = tl.dot(weights.to(v.dtype), v, acc * rescale[:, None], input_precision=PRECISION)
        if MOMENTS:
            moments = _moments(moments, weights, clean, rescale, rows[:, None] + kv - n, keys)
        maximum = grown
    return maximum, total, acc, top, first_nan, moments


def _moments(moments, weights, clean, rescale, own, keys):
    """The rows' running moments with one block of keys: its weights exp2(clean - shift), rescaled as the total."""
    weighted, distance, squared, past_first = moments
    apart = tl.abs(own - keys[None, :]).to(tl.float32)  # (BLOCK_M, BLOCK_N): |i - j|
    weighted = weighted * rescale + _total(tl.where(weights > 0, weights * clean, 0.0), 1)
    distance = distance * rescale + _total(weights * apart, 1)
    squared = squared * rescale + _total(weights * apart * apart, 1)
    past_first = tl.maximum(past_first, _largest(tl.where(keys[None, :] >= 1, clean, float("-inf")), 1))
    return weighted, distance, squared, past_first


def _store_moments(at, moments, total, rows, MOMENTS: tl.constexpr):
    """Where MOMENTS: the rows' 4 moments from `at`, sums over the total, logits back to natural units."""
    if MOMENTS:
        weighted, distance, squared, past_first = moments
        tl.store(at, weighted / total * 0.6931471805599453, mask=rows)
        tl.store(at + 1, distance / total, mask=rows)
        tl.store(at + 2, squared / total, mask=rows)
        tl.store(at + 3, past_first * 0.6931471805599453, mask=rows)


def _tile(at, keys, dims, stride_key, stride_dim, kv, SIZE: tl.constexpr, PADDED: tl.constexpr,
          MASKED: tl.constexpr):
    """(BLOCK_N, PADDED) keys or values: masked past kv only in a MASKED block, past SIZE only in a padded head."""
    pointers = at + keys[:, None] * stride_key + dims[None, :] * stride_dim
    if MASKED and SIZE == PADDED:
        tile = tl.load(pointers, mask=keys[:, None] < kv, other=0.0)
    elif MASKED:
        tile = tl.load(pointers, mask=(keys[:, None] < kv) & (dims[None, :] < SIZE), other=0.0)
    elif SIZE == PADDED:
        tile = tl.load(pointers)
    else:
        tile = tl.load(pointers, mask=dims[None, :] < SIZE, other=0.0)
    return tile


DIAGONAL, COLUMN = 0, 1  # a label's kind, as the kernel reads it


def label_weights(statistics: FusedStatistics, offsets: tuple[int, ...], keys: tuple[int, ...]) -> Tensor:
    """The record's `tables`: (b, hq, n, len(offsets) + len(keys)) float32, A[i, i + offset] for each offset, then
    A[i, key] for each key, in one Triton launch over every query row without host synchronisation. Each row loads
    the one key it reads per label where it lies (never gathered into a copy), makes it and the query float32
    (docs/precision.md) and writes exp(logit - lse), exactly 0 where the key does not exist or is hidden."""
    query, key, bias, lse = statistics.query, statistics.key, statistics.bias, statistics.lse
    key_mask, window, causal, interpreter = statistics.key_mask, statistics.window, statistics.causal, interpreted()
    b, hq, n, d = query.shape
    hk, kv = key.shape[1], key.shape[2]
    count = len(offsets) + len(keys)
    out = torch.empty(b, hq, n, count, dtype=torch.float32, device=query.device)
    if not count or not n:
        return out
    if bias is not None:
        bias = broadcast_bias(bias, (b, hq, n, kv))
    rows = 32 if interpreter else 64  # the interpreter's cost is per step: small blocks waste nothing there
    _label_kernel(interpreter)[(-(-n // rows), b * hq)](
        query, key, bias if bias is not None else lse, key_mask if key_mask is not None else lse, lse,
        _labels(offsets, keys, query.device), out,
        *query.stride(), *key.stride(), *(bias.stride() if bias is not None else (0, 0, 0, 0)),
        *(key_mask.stride() if key_mask is not None else (0, 0)),
        n, kv, hq, hq // hk, d, count, statistics.scaling, window or 0, HAS_BIAS=bias is not None,
        HAS_KEY_MASK=key_mask is not None and bias is None, WINDOWED=window is not None and bias is None,
        CAUSAL=causal and bias is None, BLOCK_M=rows, HEAD=padded(d), num_warps=4)
    return out


@functools.lru_cache(maxsize=64)
def _labels(offsets: tuple[int, ...], keys: tuple[int, ...], device: torch.device) -> Tensor:
    """(labels, 2) int32 on `device`: (kind, offset or key) per label; made once per set of labels."""
    rows = [(DIAGONAL, offset) for offset in offsets] + [(COLUMN, key) for key in keys]
    return uploaded(torch.tensor(rows, dtype=torch.int32), device)


@functools.lru_cache(maxsize=2)
def _label_kernel(interpreter: bool) -> Any:
    """The label kernel, compiled by Triton or wrapped by its interpreter (one decoration per mode)."""
    del interpreter  # the cache key
    global triton, tl
    triton, tl = importlib.import_module("triton"), importlib.import_module("triton.language")
    return triton.jit(_label_rows)


def _label_rows(Q, K, B, KeyMask, Lse, Labels, Out, sqb, sqh, sqn, sqd, skb, skh, skn, skd, sbb, sbh, sbn, sbk,
                smb, smk, n, kv, hq, group, d, count, scaling, window, HAS_BIAS: tl.constexpr,
                HAS_KEY_MASK: tl.constexpr, WINDOWED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                HEAD: tl.constexpr):
    """BLOCK_M query rows of one (sequence, query head): each label's weight per row. A row's logit is the float32
    sum of its float32 products (tl.reduce with Triton's combine function: the interpreter serves it however Triton
    was imported)."""
    sequence, head = (tl.program_id(1) // hq).to(tl.int64), tl.program_id(1) % hq
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD)
    present = rows < n
    q = tl.load(Q + sequence * sqb + head * sqh + rows[:, None].to(tl.int64) * sqn + dims[None, :] * sqd,
                mask=present[:, None] & (dims[None, :] < d), other=0.0).to(tl.float32)
    lse = tl.load(Lse + (sequence * hq + head) * n + rows, mask=present, other=0.0)
    k_base = K + sequence * skb + (head // group) * skh  # the key/value head this query head reads
    for label in range(0, count):
        kind, at = tl.load(Labels + 2 * label), tl.load(Labels + 2 * label + 1)
        keys = tl.where(kind == 1, at + rows * 0, rows + at)  # the key each row reads (kind 1: a column)
        exists = present & (keys >= 0) & (keys < kv)
        k = tl.load(k_base + keys[:, None].to(tl.int64) * skn + dims[None, :] * skd,
                    mask=exists[:, None] & (dims[None, :] < d), other=0.0).to(tl.float32)
        logits = tl.reduce(q * k, 1, tl.standard._sum_combine) * scaling
        if HAS_BIAS:
            logits = logits + tl.load(B + sequence * sbb + head * sbh + rows.to(tl.int64) * sbn + keys * sbk,
                                      mask=exists, other=0.0).to(tl.float32)
        hidden = ~exists
        if HAS_KEY_MASK:  # the sequence's own padding: one byte per key, read where the key lies
            hidden = hidden | (tl.load(KeyMask + sequence * smb + keys * smk, mask=exists, other=0) == 0)
        if CAUSAL:
            hidden = hidden | (keys > rows + kv - n)
        if WINDOWED:
            hidden = hidden | (keys <= rows + kv - n - window)
        logits = tl.where(hidden, float("-inf"), logits)
        tl.store(Out + ((sequence * hq + head) * n + rows) * count + label, tl.exp(logits - lse), mask=present)

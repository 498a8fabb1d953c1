"""The FlexAttention backend: torch's `flex_attention`, compiled into one fused Triton kernel that returns each row's
log-sum-exp and largest logit (`max_scores`) beside the output. Masks go as a block mask and a `mask_mod`, a bias as a
`score_mod`, grouped heads as they are (`enable_gqa`).

Its search (`MaximaSearch`) answers positional's question from the row maxima: a neighbour below its row's maximum by
more than the kernel's rounding is beaten, one holding over half its row's weight is the top; the rest are computed
whole, or, past WHOLE_ROWS of all (a previous-token head), every row's top key comes from the Triton statistics pass.
CUDA only: on the CPU torch refuses `max_scores` (tests use the eager CPU path for the masks). A torch without
`AuxRequest` (before 2.9) is asked with `return_lse=True` and its statistics take the Triton pass's top keys.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from probe.kernels.base import (DEFAULT_CONFIG, AttentionCall, FusedStatistics, KernelConfig, broadcast_bias,
                                float32_copy, padded, rebuild_problem, triton_problem, zero_padded)
from probe.kernels.fused import Weights
from probe.kernels.sdpa import top_keys

NAME = "flex-attention"
ROUNDING = 2.0**-8  # the kernel's logit against a float32 one, per scale |q| |k|: a bfloat16 rounding of a scaled
# query (PRESCALE_QK) or TF32 products are within it; float32 sums and the log2 round trip are far below
SLACK = 2.0**-16  # relative rounding of the maximum, the log-sum-exp and a logit rebuilt from a weight
MARGIN = 1e-4  # a neighbour is surely the top when its weight exceeds half its row's by this, besides the rounding
WHOLE_ROWS = 1 / 16  # of the rows, the most the maxima may leave undecided for whole rows; past it, one Triton pass

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def flex_module() -> Any | None:
    """torch.nn.attention.flex_attention, or None where this torch has none."""
    try:
        return importlib.import_module("torch.nn.attention.flex_attention")
    except ImportError:
        return None


class FlexBackend:
    """FlexAttention on CUDA tensors: causal, any additive mask or bias, grouped-query heads, dv != d."""

    name = NAME

    def problem(self, call: AttentionCall) -> str:
        """"" where FlexAttention serves the call, else why not. Reads shapes, dtypes and devices only."""
        if shared := rebuild_problem(call):
            return shared
        if flex_module() is None:
            return "this torch has no torch.nn.attention.flex_attention (torch 2.5 or later)"
        device = call.query.device.type
        if device != "cuda":
            return f"FlexAttention's row maxima are computed on cuda only, not {device} (torch refuses them there)"
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (torch.compile builds FlexAttention's kernel with it)"
        if not torch._dynamo.is_dynamo_supported():
            return "torch.compile does not run on this Python (FlexAttention's kernel is built by it)"
        return triton_problem(call, "FlexAttention")

    def run(self, call: AttentionCall, config: KernelConfig = DEFAULT_CONFIG) -> tuple[Tensor, FusedStatistics]:
        """(output (b, n, hq, dv), statistics with the log-sum-exp and row maxima); key mask and window as a bias."""
        call = call.with_dense_bias()  # the statistics below read the same bias
        output, lse, maxima = flex_outputs(call, compiled_flex())
        return output, flex_statistics(call.query, call.key, call.bias, call.scaling, call.causal and call.bias is None,
                                       lse, config, maxima)


@functools.cache
def compiled_flex() -> Callable[..., Any]:
    """flex_attention compiled once per process (its eager form forms the n x n matrix)."""
    module = flex_module()
    assert module is not None
    return torch.compile(module.flex_attention)


def aux_request() -> tuple[dict[str, Any], bool]:
    """(keyword arguments asking for the log-sum-exp and, where this torch has them, the row maxima; whether it has
    them): `return_aux=AuxRequest(...)` from torch 2.9, `return_lse=True` before."""
    module = flex_module()
    request = getattr(module, "AuxRequest", None)
    if request is None:
        return {"return_lse": True}, False
    if "max_scores" in request._fields:
        return {"return_aux": request(lse=True, max_scores=True)}, True
    return {"return_aux": request(lse=True)}, False


def unpacked(result: tuple[Tensor, Any]) -> tuple[Tensor, Tensor, Tensor | None]:
    """(output, log-sum-exp, row maxima or None) of flex_attention's answer in either form."""
    output, aux = result
    if isinstance(aux, Tensor):
        return output, aux, None
    return output, aux.lse, getattr(aux, "max_scores", None)


def flex_outputs(call: AttentionCall, attend: Callable[..., Any], maxima: bool = True,
                 ) -> tuple[Tensor, Tensor, Tensor | None]:
    """(output (b, n, hq, dv), log-sum-exp (b, hq, n), row maxima or None) of the call through `attend` (compiled, or
    eager in tests); `maxima=False` asks for the log-sum-exp alone (what the CPU gives)."""
    call = call.with_dense_bias()
    # each head padded to a power of two, at least 16 (the kernel's tiles)
    query, key, value = (zero_padded(tensor, padded(tensor.shape[-1])) for tensor in (call.query, call.key, call.value))
    score_mod, mask_mod = modifications(call)
    block_mask = None if mask_mod is None else block_mask_for(mask_mod, call)
    kwargs, has_maxima = aux_request()
    if not maxima and "return_aux" in kwargs:
        kwargs = {"return_aux": type(kwargs["return_aux"])(lse=True)}
    output, lse, row_maxima = unpacked(attend(query, key, value, score_mod=score_mod, block_mask=block_mask,
                                              scale=call.scaling, enable_gqa=query.shape[1] != key.shape[1],
                                              **kwargs))
    dv = call.value.shape[-1]
    output = output[..., :dv].transpose(1, 2).contiguous()
    return output, lse.float(), row_maxima.float() if has_maxima and maxima and row_maxima is not None else None


def modifications(call: AttentionCall) -> tuple[ScoreMod | None, MaskMod | None]:
    """(score_mod, mask_mod) of the call: a bias' -inf entries hide keys (whole hidden blocks skipped) and its finite
    ones are added; plain causal hides keys after the query (shifted by kv - n); else neither."""
    b, hq, n, _ = call.query.shape
    kv = call.key.shape[2]
    if call.bias is not None:
        bias = broadcast_bias(call.bias, (b, hq, n, kv))

        def add_bias(score: Tensor, batch: Tensor, head: Tensor, row: Tensor, key: Tensor) -> Tensor:
            return score + bias[batch, head, row, key]

        def visible(batch: Tensor, head: Tensor, row: Tensor, key: Tensor) -> Tensor:
            return bias[batch, head, row, key] > float("-inf")

        return add_bias, visible
    if call.causal:
        return None, causal_mask(kv - n)
    return None, None


def causal_mask(offset: int) -> MaskMod:
    """The mask_mod of plain causal attention: key j visible from query i where j <= i + offset (kv - n)."""
    def causal(batch: Tensor, head: Tensor, row: Tensor, key: Tensor) -> Tensor:
        return key <= row + offset

    return causal


def block_mask_for(mask_mod: MaskMod, call: AttentionCall) -> Any:
    """The block mask of `mask_mod`: per sequence and head where the bias has them; plain causal's made once."""
    b, hq, n, _ = call.query.shape
    kv = call.key.shape[2]
    bias = call.bias
    if bias is None and call.causal:
        return _causal_block_mask(n, kv, call.query.device)
    sequences = b if bias is None or (bias.dim() == 4 and bias.shape[0] > 1) else None
    heads = hq if bias is not None and bias.dim() >= 3 and bias.shape[-3] > 1 else None
    return _block_mask(mask_mod, sequences, heads, n, kv, call.query.device)


@functools.lru_cache(maxsize=8)
def _causal_block_mask(n: int, kv: int, device: torch.device) -> Any:
    """The block mask of plain causal attention, kept per shape and device."""
    return _block_mask(causal_mask(kv - n), None, None, n, kv, device)


def _block_mask(mask_mod: MaskMod, sequences: int | None, heads: int | None, n: int, kv: int,
                device: torch.device) -> Any:
    """create_block_mask, by a compiled pass on CUDA (no dense n x kv mask in memory)."""
    module = flex_module()
    assert module is not None
    return module.create_block_mask(mask_mod, sequences, heads, n, kv, device=device,
                                    _compile=device.type == "cuda")


def flex_statistics(query: Tensor, key: Tensor, bias: Tensor | None, scaling: float, causal: bool, lse: Tensor,
                    config: KernelConfig = DEFAULT_CONFIG, maxima: Tensor | None = None) -> FusedStatistics:
    """FlexAttention's record: float32 queries and keys, the kernel's row maxima (or None) and `MaximaSearch`."""
    return FusedStatistics(NAME, float32_copy(query), float32_copy(key), lse, scaling, causal, bias,
                           row_maxima=maxima, search=MAXIMA_SEARCH, config=config)


class MaximaSearch:
    """neighbour_hits from the row maxima (the module's docstring), argmax's answer exactly. Without maxima (calls read
    side by side; an older torch): the Triton pass's top keys where it serves the call, else whole rows."""

    def neighbour_hits(self, weights: Weights, selected: Tensor, shift: int) -> Tensor:
        """(hq,) float64 on the statistics' device: how many selected queries i have their top key at i + shift."""
        maxima = weights.statistics.row_maxima
        if maxima is None or weights.statistics.top_keys is not None:
            if weights.statistics.top_keys is None:
                self.triton_top_keys(weights)
            return weights.counted_hits(selected, shift)
        b, hq, n, _ = weights.shape
        chosen = selected.to(weights.lse.device)[:, None, :n].expand(b, hq, n)
        top, undecided = self.decided(weights, maxima, shift)
        hits = (top & chosen).sum(dim=(0, 2), dtype=torch.float64)
        found = (undecided & chosen).nonzero()  # (k, 3): b, h, query
        if len(found) > WHOLE_ROWS * b * hq * n and self.triton_top_keys(weights):
            return weights.counted_hits(selected, shift)  # from the top keys just computed
        if len(found):
            tops = weights.tops_of_rows(found, found[:, 2] + shift)
            hits += torch.bincount(found[tops, 1], minlength=hq).to(hits)
        return hits

    def reads(self, statistics: FusedStatistics, shifts: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """RowSearch.reads: the neighbours' diagonals where row maxima decide rows; none without maxima."""
        return (tuple(sorted(set(shifts))), ()) if statistics.row_maxima is not None else ((), ())

    def triton_top_keys(self, weights: Weights) -> bool:
        """Every row's top key by the Triton statistics pass, kept in the record; False where it does not serve."""
        weights.statistics.top_keys = top_keys(AttentionCall(weights.query, weights.key, weights.key,
                                                             weights.dense_bias, weights.scaling, weights.causal))
        return weights.statistics.top_keys is not None

    def decided(self, weights: Weights, maxima: Tensor, shift: int) -> tuple[Tensor, Tensor]:
        """(top, undecided), (b, hq, n) bool, for the neighbour i + shift of every query: top where it holds over half
        the row's weight; beaten where its logit is below the row's maximum by more than `rounding`; undecided
        otherwise, or where a NaN is involved."""
        weight = weights.aligned(shift)  # exactly 0 where the neighbour does not exist or is hidden
        logit = torch.log(weight) + weights.lse  # the neighbour's logit (-inf where its weight is 0)
        rounding = self.rounding(weights, logit, maxima)
        beaten = logit < maxima - rounding
        top = weight * torch.exp(-rounding) > 0.5 + MARGIN  # the log-sum-exp errs by rounding at most
        unsure = weights.lse.isnan() | maxima.isnan() | weight.isnan()
        return top & ~unsure, ~top & ~beaten | unsure

    def rounding(self, weights: Weights, logit: Tensor, maxima: Tensor) -> Tensor:
        """(b, hq, n): how far the kernel's maximum may lie from the float32 logit of the same key: ROUNDING x scale
        |q_i| max_j |k_j| for the products, SLACK of the magnitudes for the rest."""
        b, hq, n, _ = weights.shape
        hk = weights.key.shape[1]
        longest = weights.key.norm(dim=-1).amax(dim=-1)  # (b, hk)
        longest = longest.repeat_interleave(hq // hk, dim=1)[..., None]  # (b, hq, 1)
        products = ROUNDING * weights.scaling * weights.query.norm(dim=-1) * longest
        finite = torch.where(logit.isfinite(), logit.abs(), 0.0)
        return products + SLACK * (maxima.abs() + weights.lse.abs() + finite + 1.0)


MAXIMA_SEARCH = MaximaSearch()

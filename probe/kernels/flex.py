"""The FlexAttention backend: torch's `flex_attention`, compiled by torch.compile into one fused Triton kernel, which
returns each query row's log-sum-exp and its largest logit (`max_scores`) beside the output. Masks go to it as a block
mask (whole blocks of hidden keys skipped) and a `mask_mod`; an additive bias (ALiBi-like) as a `score_mod`;
grouped- and multi-query heads as they are (`enable_gqa`).

Its statistics' search (`MaximaSearch`) answers positional's question (is the neighbour its row's top key?) from the row
maxima: a neighbour whose logit is below its row's maximum by more than the kernel's rounding is beaten, and one that
holds more than half its row's weight is the top; the rows neither decides (the neighbour at the maximum, where a
tie with an earlier key, or a key within the kernel's rounding, would change argmax's answer) are computed whole
(`Weights.tops_of_rows`), or, where they are more than WHOLE_ROWS of all (a previous-token head's), every row's
top key comes from one pass of the Triton kernel's statistics (probe.kernels.cuda.attention_statistics). A row's top
key itself (`row_tops`) needs the index, which a maximum does not give: those rows are computed whole. Counting the
undecided rows reads a number back from the GPU (one wait per neighbour and layer), which the Triton backend's top
keys do not.

CUDA only: on the CPU torch refuses `max_scores` (eager and compiled) and its compiled CPU kernel refuses the
log-sum-exp; the eager CPU path gives the log-sum-exp only, from the whole n x n matrix (tests use it to check the
masks built here). torch 2.9 and later ask with `return_aux=AuxRequest(lse=True, max_scores=True)`; a torch whose
`flex_attention` has no `AuxRequest` is asked with `return_lse=True`, and its statistics, without maxima, take the
Triton pass's top keys (whole rows where Triton does not serve the call).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from probe.kernels.base import AttentionCall, FusedStatistics, float32_copy, rebuild_problem
from probe.kernels.config import DEFAULT_CONFIG, KernelConfig
from probe.kernels.cuda import CudaBackend, attention_statistics
from probe.kernels.fused import Weights

NAME = "flex-attention"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256
ROUNDING = 2.0**-8  # the kernel's logit against a float32 one, per scale |q| |k|: a bfloat16 rounding of a scaled
# query (PRESCALE_QK) or TF32 products are within it; float32 sums and the log2 round trip are far below
SLACK = 2.0**-16  # relative rounding of the maximum, the log-sum-exp and a logit rebuilt from a weight
MARGIN = 1e-4  # a neighbour is surely the top when its weight exceeds half its row's by this, besides the rounding
WHOLE_ROWS = 1 / 16  # of the rows, the most the maxima may leave undecided for whole rows (Weights.tops_of_rows)
# to settle them; more (a previous-token head: its neighbour is at most rows' maximum) and one Triton statistics pass
# over the call gives every row's top key instead

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def flex_module() -> Any | None:
    """torch.nn.attention.flex_attention, or None where this torch has none."""
    try:
        return importlib.import_module("torch.nn.attention.flex_attention")
    except ImportError:
        return None


class FlexBackend:
    """FlexAttention on CUDA tensors of float32, bfloat16 or float16, head sizes up to 256 (padded to a power of two,
    at least 16), causal, any additive mask or bias, grouped-query heads, dv != d."""

    name = NAME

    def problem(self, call: AttentionCall) -> str:
        """"" where FlexAttention serves the call, else why not. Reads shapes, dtypes and devices only."""
        shared = rebuild_problem(call)
        if shared:
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
        kernel_takes = (
            (call.query.dtype in DTYPES and call.key.dtype == call.value.dtype == call.query.dtype,
             f"queries, keys and values of {call.query.dtype} (FlexAttention takes float32, bfloat16, float16)"),
            (max(call.query.shape[-1], call.value.shape[-1]) <= MAX_HEAD_DIM, f"head size over {MAX_HEAD_DIM}"),
            (call.bias is None or call.bias.dim() <= 4, "a bias of more than 4 dimensions"))
        return next((reason for takes, reason in kernel_takes if not takes), "")

    def run(self, call: AttentionCall, config: KernelConfig = DEFAULT_CONFIG) -> tuple[Tensor, FusedStatistics]:
        """(output (b, n, hq, dv) in the value's dtype, statistics with the float32 log-sum-exp and row maxima). A key
        mask and window go as the dense bias they stand for (its -inf entries the block mask)."""
        call = call.with_dense_bias()  # the statistics below read the same bias
        output, lse, maxima = flex_outputs(call, compiled_flex())
        return output, flex_statistics(call.query, call.key, call.bias, call.scaling, call.causal and call.bias is None,
                                       lse, config, maxima)


@functools.cache
def compiled_flex() -> Callable[..., Any]:
    """flex_attention compiled once per process (its eager form forms the n x n matrix); shapes that change between
    calls are compiled dynamic after the first change (torch.compile's default)."""
    module = flex_module()
    assert module is not None
    return torch.compile(module.flex_attention)


def aux_request() -> tuple[dict[str, Any], bool]:
    """(keyword arguments asking flex_attention for the log-sum-exp and, where this torch has them, the row maxima;
    whether it has them): `return_aux=AuxRequest(...)` from torch 2.9, `return_lse=True` before."""
    module = flex_module()
    request = getattr(module, "AuxRequest", None)
    if request is None:
        return {"return_lse": True}, False
    if "max_scores" in request._fields:
        return {"return_aux": request(lse=True, max_scores=True)}, True
    return {"return_aux": request(lse=True)}, False


def unpacked(result: tuple[Tensor, Any]) -> tuple[Tensor, Tensor, Tensor | None]:
    """(output, log-sum-exp, row maxima or None) of flex_attention's answer in either form (an AuxOutput, or the
    log-sum-exp alone)."""
    output, aux = result
    if isinstance(aux, Tensor):
        return output, aux, None
    return output, aux.lse, getattr(aux, "max_scores", None)


def flex_outputs(call: AttentionCall, attend: Callable[..., Any], maxima: bool = True,
                 ) -> tuple[Tensor, Tensor, Tensor | None]:
    """(output (b, n, hq, dv), log-sum-exp (b, hq, n) float32, row maxima (b, hq, n) float32 or None) of the call
    through `attend` (flex_attention compiled, or eager in tests); `maxima=False` asks for the log-sum-exp alone (what
    the CPU gives). A key mask and window go as the dense bias they stand for."""
    call = call.with_dense_bias()
    query, key, value = padded_heads(call)
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


def padded_heads(call: AttentionCall) -> tuple[Tensor, Tensor, Tensor]:
    """Query, key and value with head sizes padded by zero columns to a power of two, at least 16 (the kernel's tiles;
    a zero column adds nothing to a logit, and the output's extra columns are dropped): 64 and 128 are unchanged."""
    def padded(tensor: Tensor) -> Tensor:
        size = tensor.shape[-1]
        wanted = max(16, 1 << (size - 1).bit_length())
        return tensor if wanted == size else F.pad(tensor, (0, wanted - size))

    return padded(call.query), padded(call.key), padded(call.value)


def modifications(call: AttentionCall) -> tuple[ScoreMod | None, MaskMod | None]:
    """(score_mod, mask_mod) of the call: where its masks come from (the one place to change when the call carries key
    lengths or a window as numbers instead of a dense bias). A bias: its -inf entries hide keys (the mask, so that
    whole hidden blocks are skipped) and its finite ones are added (the score); plain causal: keys after the query
    hidden (a key/value prefix shifts the diagonal by kv - n); else neither."""
    b, hq, n, _ = call.query.shape
    kv = call.key.shape[2]
    if call.bias is not None:
        bias = call.bias[(None,) * (4 - call.bias.dim())].expand(b, hq, n, kv)  # broadcast dimensions: stride 0

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
    """The block mask of `mask_mod` (modifications') over the call's queries and keys: per sequence and head where
    the bias has those dimensions (per sequence where there is none), else one for all; plain causal attention's is
    made once per shape and device (every layer of a forward shares it)."""
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
    """FlexAttention's record: half-precision queries and keys as whole float32 copies (the Triton pass and the
    whole rows read them), each row's largest logit as the kernel computed it (`row_maxima`, None where this torch
    gives none), and `MaximaSearch`, which answers positional's question from them where they decide the row."""
    return FusedStatistics(NAME, float32_copy(query), float32_copy(key), lse, scaling, causal, bias,
                           row_maxima=maxima, search=MAXIMA_SEARCH, config=config)


class MaximaSearch:
    """neighbour_hits from the row maxima (the module's docstring): rows they decide are counted on the statistics'
    device; the rest are computed whole (Weights.tops_of_rows), argmax's answer exactly. Without maxima (layer calls
    read side by side, which keeps top keys only; a torch that gives none): the Triton pass's top keys where it
    serves the call, else whole rows."""

    def neighbour_hits(self, weights: Weights, selected: Tensor, shift: int) -> Tensor:
        """(hq,) float64 on the statistics' device: how many selected queries i have their top key at i + shift."""
        maxima = weights.statistics.row_maxima
        if maxima is None or weights.top_keys is not None:
            if weights.top_keys is None:
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
        """What neighbour_hits reads of the prefetched table (RowSearch.reads): the neighbours' diagonals where the
        row maxima decide rows (`decided`); none without maxima (the Triton pass's top keys answer)."""
        return (tuple(sorted(set(shifts))), ()) if statistics.row_maxima is not None else ((), ())

    def triton_top_keys(self, weights: Weights) -> bool:
        """Compute every row's top key by the Triton kernel's statistics pass (probe.kernels.cuda, on the float32
        queries and keys kept here) and keep them in the record (`top_keys`); False where the kernel does not serve
        the call."""
        bias = weights.dense_bias
        call = AttentionCall(weights.query, weights.key, weights.key, bias, weights.scaling, weights.causal)
        if CudaBackend().problem(call):
            return False
        weights.statistics.top_keys = attention_statistics(weights.query, weights.key, bias, weights.scaling,
                                                           weights.causal)[1]
        return True

    def decided(self, weights: Weights, maxima: Tensor, shift: int) -> tuple[Tensor, Tensor]:
        """(top, undecided), (b, hq, n) bool, for the neighbour i + shift of every query: top where it holds more than
        half the row's weight (no other key can reach it); beaten where its logit is below the row's maximum by more
        than the kernel's rounding (`rounding`, which also bounds the log-sum-exp's error); undecided otherwise, and
        where a NaN is involved."""
        weight = weights.aligned(shift)  # exactly 0 where the neighbour does not exist or is hidden
        logit = torch.log(weight) + weights.lse  # the neighbour's logit (-inf where its weight is 0)
        rounding = self.rounding(weights, logit, maxima)
        beaten = logit < maxima - rounding
        top = weight * torch.exp(-rounding) > 0.5 + MARGIN  # the log-sum-exp errs by rounding at most
        unsure = weights.lse.isnan() | maxima.isnan() | weight.isnan()
        return top & ~unsure, ~top & ~beaten | unsure

    def rounding(self, weights: Weights, logit: Tensor, maxima: Tensor) -> Tensor:
        """(b, hq, n): how far the kernel's maximum may lie from the float32 logit of the same key, at most: ROUNDING x
        scale |q_i| max_j |k_j| (per key/value head) for the products, SLACK of the magnitudes for the rest."""
        b, hq, n, _ = weights.shape
        hk = weights.key.shape[1]
        longest = weights.key.norm(dim=-1).amax(dim=-1)  # (b, hk)
        longest = longest.repeat_interleave(hq // hk, dim=1)[..., None]  # (b, hq, 1)
        products = ROUNDING * weights.scaling * weights.query.norm(dim=-1) * longest
        finite = torch.where(logit.isfinite(), logit.abs(), 0.0)
        return products + SLACK * (maxima.abs() + weights.lse.abs() + finite + 1.0)


MAXIMA_SEARCH = MaximaSearch()

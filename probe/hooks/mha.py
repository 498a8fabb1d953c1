"""`nn.MultiheadAttention`: its forward is replaced, while hooked, by the same blocked computation."""

from __future__ import annotations

import types
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from probe.errors import ProbeError
from probe.hooks.blocked import blocked_attention
from probe.hooks.points import fire_heads, fire_inputs, fire_weights, fires
from probe.hooks.restore import put_back
from probe.hooks.types import AttentionInputs, LayerHooks, Undo
from probe.kernels.base import boolean_as_additive


def _batch_first(self: nn.MultiheadAttention, query: Tensor, key: Tensor, value: Tensor,
                 key_padding_mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor | None, bool]:
    """The inputs as (N, L, E), whatever layout the module takes; and whether they came unbatched."""
    unbatched = query.dim() == 2
    if unbatched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    if not self.batch_first or unbatched:  # (L, N, E) -> (N, L, E)
        query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
    return query, key, value, key_padding_mask, unbatched


def _project(self: nn.MultiheadAttention, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(N, L, E) inputs -> q (b, h, n, d), k and v (b, h, kv, d)."""
    batch, n_queries, _ = query.shape
    n_keys, heads = key.shape[1], self.num_heads
    head_dim = self.embed_dim // heads
    if self._qkv_same_embed_dim:
        w_q, w_k, w_v = self.in_proj_weight.chunk(3)
    else:
        w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
    b_q, b_k, b_v = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None, None, None)
    q = F.linear(query, w_q, b_q).view(batch, n_queries, heads, head_dim).transpose(1, 2)
    k = F.linear(key, w_k, b_k).view(batch, n_keys, heads, head_dim).transpose(1, 2)
    v = F.linear(value, w_v, b_v).view(batch, n_keys, heads, head_dim).transpose(1, 2)
    return q, k, v


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """MHA's boolean masks mean "do not attend"; float masks are additive already."""
    return boolean_as_additive(~mask, dtype) if mask.dtype == torch.bool else mask


def _combined_mask(attn_mask: Tensor | None, key_padding_mask: Tensor | None, q: Tensor, n_keys: int
                   ) -> Tensor | None:
    """One additive float mask broadcastable to (b, h, n, kv), or None."""
    batch, heads, n_queries, _ = q.shape
    mask = None
    if attn_mask is not None:
        mask = _additive(attn_mask, q.dtype)
        mask = mask.view(batch, heads, n_queries, n_keys) if mask.dim() == 3 else mask.view(1, 1, n_queries, n_keys)
    if key_padding_mask is not None:
        padding = _additive(key_padding_mask, q.dtype).view(batch, 1, 1, n_keys)
        mask = padding if mask is None else mask + padding
    return mask


def _mha_forward(self: nn.MultiheadAttention, query: Tensor, key: Tensor, value: Tensor,
                 key_padding_mask: Tensor | None = None, need_weights: bool = True, attn_mask: Tensor | None = None,
                 average_attn_weights: bool = True, is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
    """nn.MultiheadAttention.forward's signature and results, computed by blocked_attention under the hooks."""
    hooks: LayerHooks = self.__dict__["_probe_hooks"]
    if self.bias_k is not None or self.add_zero_attn:
        raise ProbeError("nn.MultiheadAttention with add_bias_kv or add_zero_attn is not supported")
    query, key, value, key_padding_mask, unbatched = _batch_first(self, query, key, value, key_padding_mask)
    q, k, v = _project(self, query, key, value)
    mask = _combined_mask(attn_mask, key_padding_mask, q, k.shape[2])
    inputs = AttentionInputs(q, k, v, mask, q.shape[-1] ** -0.5)
    if fires(hooks, "inputs"):
        inputs = fire_inputs(hooks, inputs)
        q, k, v = inputs.query, inputs.key, inputs.value
    kept: list[Tensor] = []

    def on_block(start: int, weights: Tensor) -> None:
        fire_weights(hooks, start, weights, inputs)
        if need_weights:
            kept.append(weights)

    heads_out = blocked_attention(q, k, v, scaling=None, mask=mask, causal=False, on_block=on_block,
                                  dropout=self.dropout if self.training else 0.0, query_block=hooks.query_block)
    heads_out = fire_heads(hooks, heads_out.transpose(1, 2), inputs)  # (b, n, h, d)
    output = self.out_proj(heads_out.reshape(*heads_out.shape[:2], self.embed_dim))  # (b, n, E)
    if not self.batch_first or unbatched:
        output = output.transpose(0, 1)
    if unbatched:
        output = output.squeeze(1)
    if not need_weights:
        return output, None
    weights = torch.cat(kept, dim=2).to(output.dtype)  # (b, h, n, kv)
    if average_attn_weights:
        weights = weights.mean(dim=1)
    return output, weights.squeeze(0) if unbatched else weights


def install_mha(module: nn.MultiheadAttention, hooks: LayerHooks, undo: list[Undo]) -> None:
    """Replace the module's forward by `_mha_forward` reading `hooks`; `undo` gets the step that puts it back."""
    # under accelerate's hooks (device map, offloading) `forward` is its wrapper, which loads the weights and then
    # calls `_old_forward`: replace that one, so the weights are still brought in; put back exactly what was there
    target = "_old_forward" if "_old_forward" in module.__dict__ else "forward"
    previous = module.__dict__.get("_probe_hooks")  # an outer `with`'s: they run first
    undo.append(partial(put_back, module, target, module.__dict__.get(target)))
    undo.append(partial(put_back, module, "_probe_hooks", previous))
    module.__dict__["_probe_hooks"] = hooks if previous is None else previous.merged(hooks)
    setattr(module, target, types.MethodType(_mha_forward, module))

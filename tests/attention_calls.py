"""What the backend tests share about an `AttentionCall`: the same call in another dtype or on another device, and its
logits computed here (float32, hidden keys at -inf), never by a backend."""

from __future__ import annotations

import torch

from probe.kernels import AttentionCall


def moved(call: AttentionCall, dtype: torch.dtype, device: str | None = None) -> AttentionCall:
    """The call with every tensor in `dtype` (and on `device`, where given)."""
    def cast(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.to(device or tensor.device, dtype)

    key_mask = None if call.key_mask is None else call.key_mask.to(device or call.key_mask.device)
    return AttentionCall(cast(call.query), cast(call.key), cast(call.value), cast(call.bias), call.scaling,
                         call.causal, key_mask=key_mask, window=call.window)


def masked_logits(call: AttentionCall) -> torch.Tensor:
    """(b, hq, n, kv) float32 logits, hidden keys at -inf: what argmax is asked of."""
    query, key = call.query.float(), call.key.float()
    keys = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    logits = torch.matmul(query, keys.transpose(-1, -2)) * call.scaling
    bias = call.dense_bias()  # the bias, or the key mask and window made one
    if bias is not None:
        return logits + bias.float()
    n, kv = query.shape[2], key.shape[2]
    hidden = torch.arange(kv, device=query.device)[None, :] > torch.arange(n, device=query.device)[:, None] + kv - n
    return logits.masked_fill(hidden, float("-inf")) if call.causal else logits

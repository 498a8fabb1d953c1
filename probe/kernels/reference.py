"""The blocked reference backend: eager logits one block of queries at a time, float32 statistics, on any device and
dtype. Slow (it forms each block's logits), so it is not registered for the hooks: it is the check every other
backend is tested against (tests/test_backends.py), and its statistics (a record without top keys or a search)
answer row maxima from whole rows."""

from __future__ import annotations

import torch
from torch import Tensor

from probe.kernels.base import AttentionCall, FusedStatistics, rebuild_problem
from probe.kernels.config import DEFAULT_CONFIG, KernelConfig


class ReferenceBackend:
    """Eager attention in query blocks: output and each row's log-sum-exp in float32, and statistics that rebuild
    weights from float32 logits of the (possibly half-precision) queries and keys, as every backend's do."""

    name = "reference"

    def __init__(self, block: int = 256) -> None:
        self.block = block  # queries whose logits (b, hq, block, kv) it forms at once

    def problem(self, call: AttentionCall) -> str:
        """"" wherever the weights can be rebuilt at all: every device and dtype."""
        return rebuild_problem(call)

    def run(self, call: AttentionCall, config: KernelConfig = DEFAULT_CONFIG) -> tuple[Tensor, FusedStatistics]:
        """(output (b, n, hq, dv) in the value's dtype, statistics with a float32 log-sum-exp); a key mask and window
        as the dense bias they stand for."""
        call = call.with_dense_bias()
        query, key, value = call.query, call.key, call.value
        b, hq, n, _ = query.shape
        rep, kv = hq // key.shape[1], key.shape[2]
        keys = key.repeat_interleave(rep, dim=1).float()
        values = value.repeat_interleave(rep, dim=1).float()
        plain_causal = call.causal and call.bias is None
        output = values.new_empty(b, hq, n, value.shape[-1])
        lse = values.new_empty(b, hq, n)
        for start in range(0, n, self.block):
            stop = min(n, start + self.block)
            logits = torch.matmul(query[:, :, start:stop].float(), keys.transpose(-1, -2)) * call.scaling
            if call.bias is not None:
                bias = call.bias[..., start:stop, :] if call.bias.shape[-2] > 1 else call.bias
                logits = logits + bias.float()
            elif plain_causal:
                rows = torch.arange(start, stop, device=logits.device)[:, None] + kv - n
                logits = logits.masked_fill(torch.arange(kv, device=logits.device)[None, :] > rows, float("-inf"))
            lse[:, :, start:stop] = torch.logsumexp(logits, dim=-1)
            output[:, :, start:stop] = torch.matmul(torch.softmax(logits, dim=-1), values)
        statistics = FusedStatistics(self.name, query.float(), key.float(), lse, call.scaling, plain_causal, call.bias,
                                     config=config)
        return output.transpose(1, 2).to(value.dtype).contiguous(), statistics


REFERENCE = ReferenceBackend()

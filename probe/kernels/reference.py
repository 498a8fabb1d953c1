"""The blocked reference backend: eager logits one block of queries at a time, on any device and dtype. Not
registered (slow): the check every other backend is tested against (tests/test_backends.py)."""

from __future__ import annotations

import torch
from torch import Tensor

from probe.kernels.base import DEFAULT_CONFIG, AttentionCall, FusedStatistics, KernelConfig, rebuild_problem


class ReferenceBackend:
    """Eager attention in query blocks, in float32."""

    name = "reference"

    def __init__(self, block: int = 256) -> None:
        self.block = block  # queries whose logits (b, hq, block, kv) it forms at once

    def problem(self, call: AttentionCall) -> str:
        """"" wherever the weights can be rebuilt at all: every device and dtype."""
        return rebuild_problem(call)

    def run(self, call: AttentionCall, config: KernelConfig = DEFAULT_CONFIG) -> tuple[Tensor, FusedStatistics]:
        """(output (b, n, hq, dv), statistics with a float32 log-sum-exp)."""
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

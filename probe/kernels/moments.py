"""Each query row's moments of its attention, accumulated beside the log-sum-exp so that an entropy or an attention-
weighted distance needs no n x n weights:

    sum_j A_ij s_ij,  sum_j A_ij |i - j|,  sum_j A_ij (i - j)^2,  max_{j >= 1} s_ij

with s_ij the scaled, masked logit; a row's entropy is lse_i - sum_j A_ij s_ij. The Triton kernel accumulates them
in its pass (`KernelConfig.moments`); `row_moments` computes them for any other record, a chunk of rows at a time.
"""

from __future__ import annotations

import torch
from torch import Tensor

from probe.kernels.base import FusedStatistics, float32_copy
from probe.kernels.fused import Weights

MOMENTS = ("weighted_logit", "distance", "squared_distance", "largest_logit_past_first")
"""The moments' order along the record's last dimension."""
LOWEST = torch.finfo(torch.float32).min  # a hidden key's logit in the sums


def row_moments(statistics: FusedStatistics) -> Tensor:
    """(b, hq, n, 4) float32: every row's MOMENTS, from the record's queries, keys, mask and log-sum-exp."""
    weights = Weights(statistics)
    b, hq, n, kv = weights.shape
    config = statistics.config
    chunk = max(config.row_chunk, config.row_logits // max(kv * b * hq, 1))
    out = statistics.lse.new_zeros(b, hq, n, len(MOMENTS))
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        out[:, :, start:stop] = _chunk_moments(weights, start, stop)
    return out


def _chunk_moments(weights: Weights, start: int, stop: int) -> Tensor:
    """(b, hq, stop - start, 4): the moments of query rows start .. stop, hidden keys at the lowest finite logit
    (weight 0). Plain causal rows' sums come from one product (`_causal_sums`)."""
    b, hq, n, kv = weights.shape
    hk, offset = weights.key.shape[1], kv - n
    plain = weights.causal and weights.dense_bias is None
    limit = min(kv, stop + offset) if plain else kv  # keys any row sees
    query = float32_copy(weights.query[:, :, start:stop]) * weights.scaling
    grouped = query.reshape(b, hk, (hq // hk) * (stop - start), query.shape[-1])
    keys = float32_copy(weights.key[:, :, :limit])
    logits = torch.matmul(grouped, keys.transpose(-1, -2)).view(b, hq, stop - start, limit)
    own = torch.arange(start, stop, device=logits.device) + offset  # each row's own key
    positions = torch.arange(limit, device=logits.device)
    bias = weights.dense_bias
    if bias is not None:
        logits += (bias[..., start:stop, :limit] if bias.shape[-2] > 1 else bias[..., :limit]).float()
        logits.clamp_(min=LOWEST)
    elif weights.causal:
        logits.masked_fill_(positions[None, :] > own[:, None], LOWEST)
    probabilities = torch.exp(logits - weights.lse[:, :, start:stop, None])
    if plain:
        sums = _causal_sums(probabilities, query, keys, own, start)
    else:
        distance = (own[:, None] - positions[None, :]).abs().float()
        apart = probabilities * distance
        sums = [(probabilities * logits).sum(dim=-1), apart.sum(dim=-1), (apart * distance).sum(dim=-1)]
    if limit > 1:
        logits[..., 0] = LOWEST  # the largest logit past key 0, in place of a copy without it
        largest = logits.amax(dim=-1)
        sums.append(largest.masked_fill_(largest <= LOWEST, float("-inf")))  # no key past 0 seen
    else:
        sums.append(torch.full_like(sums[0], float("-inf")))
    return torch.stack(sums, dim=-1)


def _causal_sums(probabilities: Tensor, query: Tensor, keys: Tensor, own: Tensor, start: int) -> list[Tensor]:
    """sum_j A_ij s_ij, sum_j A_ij (i - j), sum_j A_ij (i - j)^2 of rows that see no key after their own, from one
    product A [K | u | u^2] with u_j = i_0 - j: i - j = (i - i_0) + u_j stays small (no cancellation)."""
    b, hq, m, limit = probabilities.shape
    hk, d = keys.shape[1], keys.shape[-1]
    u = (own[0] - torch.arange(limit, device=keys.device)).float()
    extended = torch.cat([keys, torch.stack([u, u.square()], dim=-1).expand(b, hk, limit, 2)], dim=-1)
    mixed = torch.matmul(probabilities.reshape(b, hk, (hq // hk) * m, limit), extended).view(b, hq, m, d + 2)
    t = (own - own[0]).float()  # i - i_0
    mean_u, mean_square = mixed[..., d], mixed[..., d + 1]
    return [(query * mixed[..., :d]).sum(dim=-1), t + mean_u, t.square() + 2 * t * mean_u + mean_square]


def moments_of(statistics: FusedStatistics) -> Tensor:
    """The record's moments: the backend's where it wrote them, else `row_moments`."""
    return statistics.moments if statistics.moments is not None else row_moments(statistics)

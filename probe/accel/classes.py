"""The built-in head classes' accelerators: previous token, sink, induction, duplicate token and next token as one
diagonal or column; sep, positional, streaming and retrieval as functions of the weights. Local has none."""

from __future__ import annotations

import torch
from torch import Tensor

from probe.accel.registry import Column, Diagonal, FromWeights, register_accelerator, with_key
from probe.heads.scores import (DEFAULT_RECENT, DEFAULT_SINK, NEIGHBOURS, Batch, NeedleBatch, last_keys, repeat_len,
                                retrieval_score, second_repeat, selected_sums)
from probe.kernels.fused import Weights, uploaded


def valid_on(batch: Batch, device: torch.device) -> Tensor:
    """The batch's `valid` on `device`, copied once per batch (a copy per layer would wait for a GPU each time)."""
    return batch.memo(("valid", str(device)), lambda: uploaded(batch.valid, device))


def sep_from_lse(attention: Weights, batch: Batch) -> tuple[Tensor, Tensor]:
    """sep_score's sums from the log-sum-exp: one column per distinct last position (one, without padding)."""
    device = attention.lse.device
    values = None
    for key, owners in batch.memo(("sep keys", str(device)), lambda: _last_key_owners(batch, device)):
        column = attention.column(key)  # (b, h, n)
        values = column if values is None else torch.where(owners[:, None, None], column, values)
    assert values is not None
    return selected_sums(values, valid_on(batch, device)[:, :values.shape[-1]])


def _last_key_owners(batch: Batch, device: torch.device) -> list[tuple[int, Tensor]]:
    """Each distinct last position of the batch, with the (b,) sequences ending there on `device` (once per batch)."""
    last = last_keys(batch).clamp(min=0)
    return [(int(key), uploaded(last == key, device)) for key in last.unique().tolist()]


def positional_from_lse(attention: Weights, batch: Batch) -> tuple[Tensor, Tensor]:
    """positional_score's sums and counts: for each neighbour, the valid queries whose neighbour exists and is valid,
    and how many of them have it as their argmax (`neighbour_hits`, whatever the backend answers it with)."""
    b, h, n, kv = attention.shape
    device = attention.lse.device  # the rows are taken there once per batch (memo): no copy per layer
    hits, counts = [], []
    for shift in NEIGHBOURS:
        selected, count = batch.memo(("neighbours", n, kv, shift, str(device)),
                                     lambda: _neighbour_rows(batch.valid, kv, shift, device))
        counts.append(count)
        hidden = attention.bias is None and attention.causal and shift > kv - n  # the neighbour is causally hidden
        hits.append(torch.zeros(h, dtype=torch.float64, device=device) if hidden else
                    attention.neighbour_hits(selected, shift))  # where it counts: a kernel's top keys on its device
    return torch.stack(hits), batch.memo(("neighbour counts", n, kv, h), lambda: torch.tensor(
        counts, dtype=torch.float64)[:, None].expand(2, h))  # counts: on the host (no round-trip either)


def _neighbour_rows(valid: Tensor, kv: int, shift: int, device: torch.device) -> tuple[Tensor, float]:
    """((b, n) the valid queries whose neighbour i + shift exists and is valid, on `device`, how many there are)."""
    selected = with_key(valid, valid.shape[1], kv, shift)
    return uploaded(selected, device), float(selected.sum())


def streaming_from_lse(attention: Weights, batch: Batch, sink: int = DEFAULT_SINK,
                       recent: int = DEFAULT_RECENT) -> tuple[Tensor, Tensor]:
    """streaming_score's sums and counts: the band of the `recent` keys ending at each query and the first `sink`
    columns, for queries i >= sink + recent only."""
    b, h, n, _ = attention.shape
    first = sink + recent
    if first >= n:
        return torch.zeros(h, dtype=torch.float64), torch.zeros(h, dtype=torch.float64)
    attention.prefetch((), range(sink))  # the sink columns in one pass
    sinks = sum((attention.column(key)[..., first:] for key in range(sink)), attention.lse.new_zeros(b, h, n - first))
    valid = valid_on(batch, attention.lse.device)
    sums = counts = attention.lse.new_zeros(h, dtype=torch.float64)  # on the device: nothing read back per chunk
    for start, band in attention.band(1 - recent, 0, first):  # (b, h, rows, recent): keys i - recent + 1 .. i
        stop = start + band.shape[2]
        part_sums, part_counts = selected_sums(band.sum(dim=-1) + sinks[..., start - first:stop - first],
                                               valid[:, start:stop])
        sums, counts = sums + part_sums, counts + part_counts
    return sums, counts


def retrieval_from_lse(attention: Weights, batch: Batch) -> tuple[Tensor, Tensor]:
    """retrieval_score from the log-sum-exp: only the answer rows' weights are computed, whole (exact maxima)."""
    sources, correct = getattr(batch, "sources", None), getattr(batch, "correct", None)
    if sources is None or correct is None:
        return retrieval_score(attention.lse[..., None], 0, batch)  # raises: the score needs needle prompts
    rows = ((sources >= 0) & correct & batch.valid).any(dim=0).nonzero()[:, 0]
    answers = NeedleBatch(valid=batch.valid[:, rows], offset=batch.offset, repeat_len=None, sources=sources[:, rows],
                          correct=correct[:, rows])
    return retrieval_score(attention.rows(rows.to(attention.lse.device)), 0, answers)


register_accelerator("previous_token", Diagonal(lambda batch: -1))
register_accelerator("sink", Column(0))
register_accelerator("induction", Diagonal(lambda batch: 1 - repeat_len(batch), second_repeat))
register_accelerator("duplicate_token", Diagonal(lambda batch: -repeat_len(batch), second_repeat))
register_accelerator("next_token", Diagonal(lambda batch: 1))
register_accelerator("sep", FromWeights(sep_from_lse))
register_accelerator("positional", FromWeights(positional_from_lse, NEIGHBOURS, layers_at_once=True))
register_accelerator("streaming", FromWeights(streaming_from_lse))
register_accelerator("retrieval", FromWeights(retrieval_from_lse))

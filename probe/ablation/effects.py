"""Per-token and per-sequence effects of each ablation, from the per-position values the sweep computes anyway: mean
delta, largest per-sequence delta, 99th percentile and maximum per-token delta, top affected tokens with context, and
specificity, the share of a head's loss increase its top 1% of tokens carry (about 0.01 when even, 1 when one token
takes it all; Olsson et al. 2022 read effects token by token). A chunk's values live until it finishes."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

TOP_TOKENS = 5  # affected tokens kept per ablation
CONTEXT = 6  # tokens of context before an affected token
TOP_SHARE = 0.01  # specificity: the share of the loss increase carried by this fraction of the tokens

TokenText = Callable[[Tensor, int, int], str]
"""(ids of one sequence, position of the affected token, context tokens) -> the context, the token [bracketed]."""


def token_text(tokenizer: Any) -> TokenText:
    """Context of an affected token in words (ids where the model has no tokenizer)."""

    def text(ids: Tensor, position: int, context: int) -> str:
        before = ids[max(0, position - context):position].tolist()
        token = [int(ids[position])]
        if tokenizer is None:
            return " ".join(map(str, before)) + f" [{token[0]}]"
        return tokenizer.decode(before) + "[" + tokenizer.decode(token) + "]"

    return text


def specificity(deltas: Tensor) -> float:
    """The share of the positive per-token deltas' sum held by the top TOP_SHARE of all tokens (0 if none)."""
    positive = deltas.clamp(min=0)
    total = float(positive.sum())
    if total <= 0:
        return 0.0
    k = max(1, math.ceil(TOP_SHARE * deltas.numel()))
    return float(positive.topk(min(k, positive.numel())).values.sum()) / total


class Effects:
    """Summaries of ablated runs' per-position values against the baseline's; `signs`: -1 for a task's bad rows."""

    def __init__(self, ids: list[Tensor], counted: list[Tensor], baseline: list[Tensor], shift: int,
                 text: TokenText, signs: Tensor | None = None, per_row: list[Tensor] | None = None) -> None:
        self.ids, self.counted, self.baseline, self.shift, self.text = ids, counted, baseline, shift, text
        self.signs, self.per_row = signs, per_row
        self.starts = [0]
        for batch in ids[:-1]:
            self.starts.append(self.starts[-1] + int(batch.shape[0]))

    def row_sums(self, values: list[Tensor]) -> Tensor:
        """(copies, rows) float64 sums over each sequence's counted positions; values[i] (copies, batch_i, pos')."""
        return torch.cat([(v.double() * c.to(v.device)).sum(dim=-1).cpu() for v, c in zip(values, self.counted)],
                         dim=1)

    def baseline_rows(self) -> Tensor:
        """(rows,) the baseline's sums over each sequence's counted positions."""
        return self.row_sums([b[None] for b in self.baseline])[0]

    def summarize(self, values: list[Tensor]) -> list[dict[str, Any]]:
        """One summary per copy of the chunk; values[i] (copies, batch_i, positions') of batch i."""
        deltas = [(v.float().cpu() - b[None]) for v, b in zip(values, self.baseline)]  # per batch
        if self.signs is not None:
            deltas = [d * self.signs[start:start + d.shape[1], None].float() for d, start in zip(deltas, self.starts)]
        counts = torch.cat([c.sum(dim=-1) for c in self.counted]).double()  # (rows,)
        rows = self.row_sums(deltas) / counts.clamp(min=1)  # (copies, rows) mean delta per sequence
        flat = torch.cat([d[:, c] for d, c in zip(deltas, self.counted)], dim=1).double()  # (copies, tokens)
        where = torch.cat([c.nonzero() + torch.tensor([start, 0]) for c, start in zip(self.counted, self.starts)])
        return [self._summary(flat[copy], rows[copy], where) for copy in range(flat.shape[0])]

    def _summary(self, deltas: Tensor, rows: Tensor, where: Tensor) -> dict[str, Any]:
        """deltas (tokens,) of the counted tokens, at (row, position') `where`; rows (rows,) per-sequence deltas."""
        if deltas.numel() == 0:
            return {}
        top = deltas.topk(min(TOP_TOKENS, deltas.numel()))
        return {
            "mean_delta": float(deltas.mean()),
            "max_sequence_delta": float(rows.max()),
            "p99_token_delta": float(torch.quantile(deltas, 0.99)),
            "max_token_delta": float(top.values[0]),
            "specificity": specificity(deltas),
            "top_tokens": [self._token(int(where[i, 0]), int(where[i, 1]), float(value))
                           for value, i in zip(top.values, top.indices)],
        }

    def _token(self, row: int, position: int, delta: float) -> dict[str, Any]:
        batch = max(i for i, start in enumerate(self.starts) if start <= row)
        ids = self.ids[batch][row - self.starts[batch]]
        if self.per_row is not None:  # `position` is the gold class: the context is the sequence's beginning
            first = min(2 * CONTEXT, int(self.per_row[batch][row - self.starts[batch]]) - 1)
            return {"sequence": row, "position": 0, "class": position, "delta": delta,
                    "context": self.text(ids, first, first)}
        token = position + self.shift  # the token whose prediction (or output) changed
        return {"sequence": row, "position": token, "delta": delta, "context": self.text(ids, token, CONTEXT)}

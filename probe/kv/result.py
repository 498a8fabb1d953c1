"""`KVHeads`, the result of `kv_heads`: scores per query and KV head, labels, the order, its budget and curve;
`to_dict()` (the kv-heads schema's payload) and `to_frame()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from probe.frames import frame, head_rows
from probe.kv.budget import Budget


@dataclass
class KVHeads:
    """Retrieval and streaming scores per query head and per KV head, labels, the streaming order and its check."""

    model: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    sink: int
    recent: int
    retrieval: Tensor  # (n_layers, n_heads)
    streaming: Tensor  # (n_layers, n_heads)
    kv_retrieval: Tensor  # (n_layers, n_kv_heads): max over the group
    kv_streaming: Tensor  # (n_layers, n_kv_heads): min over the group
    order: list[tuple[int, int]]
    full: set[tuple[int, int]]
    accuracy: list[dict[str, Any]]  # the model's own needle accuracy per (length, depth), on the scored prompts
    curve: dict[str, Any] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    budget: Budget | None = None
    seconds: dict[str, float] = field(default_factory=dict)  # wall time per stage: scores, order, budget, curve
    dtype: str = "float32"  # what the model ran in: docs/precision.md says how far a half-precision run lies

    def label(self, layer: int, kv_head: int) -> str:
        return "full" if (layer, kv_head) in self.full else "streaming"

    def duo_values(self) -> list[list[float]]:
        """DuoAttention's full_attention_heads (n_layers x n_kv_heads, in [0, 1], full where > 0.5): the order's
        rank spread over (0, 0.5) for streaming heads and (0.5, 1] for full ones, so that DuoAttention's own
        `sparsify_attention_heads(sparsity=...)`, which keeps the largest values, follows probe's order too."""
        streamed = [h for h in self.order if h not in self.full]
        kept = [h for h in self.order if h in self.full]
        value = {h: 0.5 * (rank + 1) / (len(streamed) + 1) for rank, h in enumerate(streamed)}
        value |= {h: 0.5 + 0.5 * (rank + 1) / len(kept) for rank, h in enumerate(kept)}
        return [[round(value[(layer, kv)], 6) for kv in range(self.n_kv_heads)] for layer in range(self.n_layers)]

    def to_dict(self) -> dict[str, Any]:
        group = self.n_heads // self.n_kv_heads
        return {
            "model": self.model, "n_layers": self.n_layers, "n_heads": self.n_heads, "n_kv_heads": self.n_kv_heads,
            "sink": self.sink, "recent": self.recent, "options": self.options, "dtype": self.dtype,
            "aggregation": "a KV head's retrieval score is the max over its query heads, its streaming score the min",
            "kv_heads": [
                {"layer": layer, "kv_head": kv, "label": self.label(layer, kv),
                 "retrieval": round(float(self.kv_retrieval[layer, kv]), 6),
                 "streaming": round(float(self.kv_streaming[layer, kv]), 6),
                 "rank": self.order.index((layer, kv)), "query_heads": list(range(kv * group, (kv + 1) * group))}
                for layer in range(self.n_layers) for kv in range(self.n_kv_heads)],
            "heads": [{"layer": layer, "head": head, "kv_head": head // group,
                       "retrieval": round(float(self.retrieval[layer, head]), 6),
                       "streaming": round(float(self.streaming[layer, head]), 6)}
                      for layer in range(self.n_layers) for head in range(self.n_heads)],
            "order": [list(h) for h in self.order],
            "n_streaming": self.n_layers * self.n_kv_heads - len(self.full),
            "needle_accuracy": self.accuracy,
            "curve": self.curve,
            "budget": None if self.budget is None else self.budget.to_dict(),
            "duo_full_attention_heads": self.duo_values(),
            "seconds": self.seconds,
        }

    def to_frame(self) -> Any:
        """A pandas DataFrame, one row per query head: layer, head, name, its KV head, retrieval and streaming
        scores, and its KV head's label and rank in the streaming order (the kv-heads schema's columns). Needs
        pandas."""
        rows = head_rows(self.to_dict()["heads"], ("kv_head", "retrieval", "streaming"))
        for row in rows:
            row["label"] = self.label(row["layer"], row["kv_head"])
            row["rank"] = self.order.index((row["layer"], row["kv_head"]))
        return frame(rows)

    def _repr_html_(self) -> str:
        from probe.reports.kv_heads import kv_heads_page  # reports render; the library never needs them otherwise

        return kv_heads_page(self.to_dict(), embed_plotly=False)

"""`KVHeads`, the result of `kv_heads` (the kv-heads schema), and `KVBudget`, the budget file beside each export."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from probe.frames import frame, record_rows
from probe.kv.budget import Budget
from probe.schemas.base import Field
from probe.schemas.common import DTYPE, HEAD, HEAD_COLUMNS, LAYER, MODEL, N_HEADS, N_LAYERS
from probe.schemas.declare import Payload, columns, payload, published, schema_field


class KVHeadEntry(Payload, frozen=True):
    """One KV head: its label, scores over its query heads, and place in the streaming order."""

    layer: int = schema_field(LAYER)
    kv_head: int = schema_field("the key/value head")
    label: str = schema_field("full or streaming")
    retrieval: float = schema_field("max over its query heads")
    streaming: float = schema_field("min over its query heads")
    rank: int = schema_field("its place in the streaming order")
    query_heads: list[int] = schema_field("its query heads", items="a query head")


class QueryHeadEntry(Payload, frozen=True):
    """One query head's scores."""

    layer: int = schema_field(LAYER)
    head: int = schema_field(HEAD)
    kv_head: int = schema_field("its key/value head", column=True)
    retrieval: float = schema_field("retrieval score", column="the head's retrieval score")
    streaming: float = schema_field("streaming score", column="the head's streaming score")


@published("kv-budget", 1, "The budget file written beside a --export: how the budget was chosen, what was measured, "
           "which KV heads stream.", rows="one per point the budget's search measured",
           columns={"k": Field("integer", "KV heads streamed, first k of the order"),
                    "loss_change": Field("number", "the loss change with them streamed"),
                    "needle_accuracy": Field("number", "the needle accuracy with them streamed"),
                    "accepted": Field("boolean", "whether the point is within the budget's rule")})
class KVBudget(Payload):
    """What an export's budget file says: the budget of a KV-head map and its streaming heads."""

    model: str = schema_field(MODEL)
    dtype: str = schema_field(DTYPE)
    sink: int = schema_field("the streaming cache's sink keys")
    recent: int = schema_field("its recent keys")
    budget: Budget | None = schema_field("the rule, the number streamed, every point measured",
                                         type=("object", "null"))

    @payload("KV heads that stream")
    def n_streaming(self) -> int:
        return len(self.streaming)

    streaming: list[tuple[int, int]] = schema_field("the streaming KV heads as [layer, kv_head]",
                                                    dump=lambda heads: [list(head) for head in heads])

    def to_frame(self) -> Any:
        """A pandas DataFrame, one row per point the budget's search measured (none without a budget). Needs pandas."""
        return frame([]) if self.budget is None else self.budget.to_frame()


@published("kv-heads", 1, "Retrieval and streaming scores per query and KV head, their labels, the streaming order and "
           "its budget (probe kv-heads --json).", rows="one per query head",
           columns=columns(HEAD_COLUMNS, QueryHeadEntry, {
               "label": Field("string", "its KV head's label: full or streaming"),
               "rank": Field("integer", "its KV head's place in the streaming order")}))
class KVHeads(Payload):
    """Retrieval and streaming scores per query head and per KV head, labels, the streaming order and its check."""

    model: str = schema_field(MODEL)
    n_layers: int = schema_field(N_LAYERS)
    n_heads: int = schema_field(N_HEADS)
    n_kv_heads: int = schema_field("key/value heads per layer")
    sink: int = schema_field("the streaming cache's sink keys")
    recent: int = schema_field("the streaming cache's recent keys")
    options: dict[str, Any] = schema_field("the options of the run", default_factory=dict, kw_only=True)
    dtype: str = schema_field(DTYPE, default="float32", kw_only=True)  # docs/precision.md: how far half precision lies
    retrieval: Tensor  # (n_layers, n_heads)
    streaming: Tensor  # (n_layers, n_heads)
    kv_retrieval: Tensor  # (n_layers, n_kv_heads): max over the group
    kv_streaming: Tensor  # (n_layers, n_kv_heads): min over the group

    @payload("how a KV head's scores come from its query heads'")
    def aggregation(self) -> str:
        return "a KV head's retrieval score is the max over its query heads, its streaming score the min"

    @payload("every KV head", items="one KV head")
    def kv_heads(self) -> list[KVHeadEntry]:
        group = self.n_heads // self.n_kv_heads
        return [KVHeadEntry(layer, kv, self.label(layer, kv), round(float(self.kv_retrieval[layer, kv]), 6),
                            round(float(self.kv_streaming[layer, kv]), 6), self.order.index((layer, kv)),
                            list(range(kv * group, (kv + 1) * group)))
                for layer in range(self.n_layers) for kv in range(self.n_kv_heads)]

    @payload("every query head", items="one query head")
    def heads(self) -> list[QueryHeadEntry]:
        group = self.n_heads // self.n_kv_heads
        return [QueryHeadEntry(layer, head, head // group, round(float(self.retrieval[layer, head]), 6),
                               round(float(self.streaming[layer, head]), 6))
                for layer in range(self.n_layers) for head in range(self.n_heads)]

    order: list[tuple[int, int]] = schema_field("KV heads as [layer, kv_head], first streamed first",
                                                dump=lambda order: [list(h) for h in order])
    full: set[tuple[int, int]]

    @payload("KV heads labelled streaming")
    def n_streaming(self) -> int:
        return self.n_layers * self.n_kv_heads - len(self.full)

    accuracy: list[dict[str, Any]] = schema_field(  # on the scored prompts
        "the model's own needle accuracy per length and depth", key="needle_accuracy")
    curve: dict[str, Any] | None = schema_field("the order's curve against random orders (null: --no-curve)",
                                                default=None)
    budget: Budget | None = schema_field("how many KV heads stream, and every point the search measured",
                                         type=("object", "null"), default=None)

    @payload("DuoAttention's full_attention_heads values, layers x KV heads", key="duo_full_attention_heads")
    def duo_values(self) -> list[list[float]]:
        """DuoAttention's full_attention_heads (n_layers x n_kv_heads, full where > 0.5): the order's rank spread
        over (0, 0.5) and (0.5, 1], so that DuoAttention's own sparsification follows probe's order too."""
        streamed = [h for h in self.order if h not in self.full]
        kept = [h for h in self.order if h in self.full]
        value = {h: 0.5 * (rank + 1) / (len(streamed) + 1) for rank, h in enumerate(streamed)}
        value |= {h: 0.5 + 0.5 * (rank + 1) / len(kept) for rank, h in enumerate(kept)}
        return [[round(value[(layer, kv)], 6) for kv in range(self.n_kv_heads)] for layer in range(self.n_layers)]

    seconds: dict[str, float] = schema_field(  # scores, order, budget, curve
        "wall time per stage", default_factory=dict)

    def budget_record(self) -> KVBudget:
        """The budget file beside an export: the budget, the cache a streaming head keeps, the streaming KV heads."""
        streaming = [(layer, kv) for layer in range(self.n_layers) for kv in range(self.n_kv_heads)
                     if (layer, kv) not in self.full]
        return KVBudget(self.model, self.dtype, self.sink, self.recent, self.budget, streaming)

    def label(self, layer: int, kv_head: int) -> str:
        return "full" if (layer, kv_head) in self.full else "streaming"

    def to_frame(self) -> Any:
        """A pandas DataFrame, one row per query head: the kv-heads schema's columns. Needs pandas."""
        rows = record_rows(self.heads)
        for row in rows:
            row["label"] = self.label(row["layer"], row["kv_head"])
            row["rank"] = self.order.index((row["layer"], row["kv_head"]))
        return frame(rows)

    def _repr_html_(self) -> str:
        from probe.reports.kv_heads import kv_heads_page  # reports render; the library never needs them otherwise

        return kv_heads_page(self.to_dict(), embed_plotly=False)

"""The order in which KV heads stream (by retrieval, or by loss), per KV head scores, and their query heads."""

from __future__ import annotations

from torch import Tensor

from probe.ablation.sweep import sweep
from probe.ablation.window import WindowAblation
from probe.hooks.layers import attention_layers
from probe.inputs import ProbeSet
from probe.errors import ProbeError
from probe.models import LoadedModel
from probe.progress import ProgressArg, reports


def kv_groups(loaded: LoadedModel) -> tuple[int, int]:
    """(query heads, KV heads) per layer: consecutive query heads share a KV head (transformers' repeat_kv order)."""
    layers = attention_layers(loaded.model)
    n_heads = max(layer.n_heads for layer in layers)
    n_kv = max(getattr(layer, "n_kv_heads", None) or n_heads for layer in layers)
    if n_heads % n_kv:
        raise ProbeError(f"{n_heads} query heads do not split into {n_kv} KV groups")
    return n_heads, n_kv


def aggregate(scores: Tensor, n_kv: int, how: str) -> Tensor:
    """(n_layers, n_heads) per query head -> (n_layers, n_kv) per KV head: "max" or "min" over each group."""
    grouped = scores.reshape(scores.shape[0], n_kv, scores.shape[1] // n_kv)
    return grouped.amax(dim=2) if how == "max" else grouped.amin(dim=2)


def stream_order(retrieval: Tensor, streaming: Tensor) -> list[tuple[int, int]]:
    """KV heads, retrieval ascending, ties by streaming descending, then by position."""
    heads = [(layer, kv) for layer in range(retrieval.shape[0]) for kv in range(retrieval.shape[1])]
    return sorted(heads, key=lambda h: (round(float(retrieval[h]), 6), -round(float(streaming[h]), 6), h))


RETRIEVAL_FLOOR = 0.1  # a KV head retrieves (for the loss order) when its retrieval score passes this
ORDERS = ("retrieval", "loss")
"""How KV heads are ordered for streaming: retrieval ascending (stream_order), or by the loss change (loss_order)."""


@reports("ordering by loss")
def loss_order(loaded: LoadedModel, kv_retrieval: Tensor, texts: ProbeSet, window: WindowAblation, *,
               batch_size: int = 1, progress: ProgressArg = None) -> tuple[list[tuple[int, int]], list[float]]:
    """(order, loss changes): KV heads by the loss change each causes streaming alone (an exact window-ablation
    sweep), those whose retrieval passes RETRIEVAL_FLOOR last, by retrieval."""
    n_layers, n_kv = kv_retrieval.shape
    group = attention_layers(loaded.model)[0].n_heads // n_kv
    heads = [(layer, kv) for layer in range(n_layers) for kv in range(n_kv)]
    swept = sweep(loaded, texts, [], groups=[tuple(query_heads([h], group)) for h in heads], method=window,
                  batch_size=batch_size, progress=progress)
    change = {(result.heads[0][0], result.heads[0][1] // group): result.delta for result in swept.results}
    retrieves = {h: float(kv_retrieval[h]) > RETRIEVAL_FLOOR for h in heads}
    order = sorted(heads, key=lambda h: (retrieves[h], float(kv_retrieval[h]) if retrieves[h] else change[h], h))
    return order, [round(change[h], 6) for h in order]


def query_heads(kv_heads: list[tuple[int, int]], group: int) -> list[tuple[int, int]]:
    """The query heads (layer, head) that share the given KV heads."""
    return [(layer, kv * group + offset) for layer, kv in kv_heads for offset in range(group)]

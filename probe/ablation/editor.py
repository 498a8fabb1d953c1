"""Applying an ablation: `ablated()` for stacked copies of a batch (at the method's own hook point), `ablate()`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager

from torch import nn

from probe.ablation.heads import Ablation, Head, check_heads
from probe.ablation.methods import AblationMethod, build_method
from probe.ablation.statistics import HeadStatistics
from probe.hooks.capture import attention_hooks
from probe.hooks.layers import AttentionLayer, attention_layers
from probe.hooks.types import BatchContext


def ablated(model: nn.Module, ablations: Sequence[Ablation], method: AblationMethod,
            batch: BatchContext | None = None) -> AbstractContextManager[list[AttentionLayer]]:
    """Stacked copies of a batch, copy i's ablations[i] replaced by `method` while the `with` runs; then restored."""
    handler, layers = method.handler(ablations)
    method.check(attention_layers(model), layers)
    return attention_hooks(model, {method.point: handler}, layers=layers, batch=batch)


@contextmanager
def ablate(model: nn.Module, heads: Iterable[Head], *, method: str | AblationMethod = "zero",
           statistics: HeadStatistics | None = None, batch: BatchContext | None = None) -> Iterator[None]:
    """Ablate `heads` together for the body of the `with` (a method of METHODS, or a method object); `batch`: the
    batch the body runs (`BatchContext.of(ids, mask)`), which the method is bound to. Restored on exit."""
    chosen = build_method(method, statistics=statistics).bound_to([] if batch is None else [batch])
    heads = tuple(heads)
    check_heads(attention_layers(model), heads)
    with ablated(model, [heads], chosen, batch):
        yield

"""Applying an ablation: `ablated()`, a method's handler for stacked copies of a batch installed at the method's own
hook point, and `ablate()`, the context manager that ablates heads for the body of a `with`.

Ablating head h of layer l replaces that head's output (its slice of the input to the layer's output projection,
before the projection) at every position, through the `z` hook point (probe.hooks.points); methods that patch a
head's query, key or value go through the `inputs` point, window ablation through `recompute`: each method says
where (`AblationMethod.point`) and makes its handler (`AblationMethod.handler`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager

from torch import nn

from probe.ablation.heads import Ablation, Head, check_heads
from probe.ablation.methods import AblationMethod, method_named
from probe.ablation.statistics import HeadStatistics
from probe.hooks.capture import attention_hooks
from probe.hooks.layers import AttentionLayer, attention_layers
from probe.hooks.types import BatchContext


def ablated(model: nn.Module, ablations: Sequence[Ablation], method: AblationMethod,
            batch: BatchContext | None = None) -> AbstractContextManager[list[AttentionLayer]]:
    """`len(ablations)` stacked copies of a batch, copy i with ablations[i]'s heads replaced by `method` (bound to
    the batches it runs: `AblationMethod.bound_to`), for the body of the `with`; `batch` is the batch it runs, handed
    to the method as `ctx.batch`. Restored on exit."""
    handler, layers = method.handler(ablations)
    method.check(attention_layers(model), layers)
    return attention_hooks(model, {method.point: handler}, layers=layers, batch=batch)


@contextmanager
def ablate(model: nn.Module, heads: Iterable[Head], *, method: str | AblationMethod = "zero",
           statistics: HeadStatistics | None = None, batch: BatchContext | None = None) -> Iterator[None]:
    """Ablate `heads` together for the body of the `with` (a method of METHODS, built with the reference
    `statistics` it reads, or a method object). `batch`: the batch the body runs (`BatchContext.of(ids, mask)`),
    which the method is bound to as a sweep binds it, and sees as `ctx.batch` (its padding, for methods that read
    it). Restored on exit."""
    chosen = method_named(method, statistics).bound_to([] if batch is None else [batch])
    heads = tuple(heads)
    check_heads(attention_layers(model), heads)
    with ablated(model, [heads], chosen, batch):
        yield

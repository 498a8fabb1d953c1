"""`Trace`: read and replace an attention layer's named hook points for the body of a `with`, in the style of
baukit's `Trace`. Its writers are the interventions of probe.ablation.methods (`scale_head`, `add_to_head`, or any
method's `writer(heads)`).

    with Trace(model, {"z": {23: scale_head(3, 2.0)}}, read=["z", "pattern"], layers=[23]) as trace:
        model(ids)
    trace[23]["z"]        # (batch, positions, heads, head_dim): what the output projection read

The points are `probe.hooks.points.POINTS`' public ones (q, k, v, z, pattern, lse). The model is restored exactly
on exit, also when the body raises or is interrupted (probe.hooks.restore).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from probe.errors import ProbeError
from probe.hooks.capture import attention_hooks
from probe.hooks.layers import attention_layers
from probe.hooks.points import POINTS, Writer, point_named, refusal
from probe.hooks.types import BatchContext, Handler, HookContext

if TYPE_CHECKING:
    from probe.kernels.base import FusedStatistics


class Trace:
    """Hook points of chosen attention layers, read and replaced while the `with` runs.

    `edit` maps a writable point's name to {layer: writer}; a writer `fn(tensor, ctx) -> tensor` returns what the
    layer goes on with (same shape; `ctx` a HookContext: `ctx.layer`, `ctx.mask`, ...). `read` names the points to
    keep, at `layers` (None: every layer); a point read where it is also edited is kept after the edit. What is kept
    is the last forward's: `trace[layer][point]` (`pattern` joined over its query blocks into (batch, query heads,
    queries, keys); `lse` the (batch, query heads, queries) log-sum-exp, absent where the layer's logits cannot be
    rebuilt from it: `trace.blocked[layer]` says why). `batch` is what the writers see as `ctx.batch` (the rows,
    padding mask and positions of the batch the body runs).
    """

    def __init__(self, model: nn.Module | Any, edit: Mapping[str, Mapping[int, Writer]] | None = None,
                 read: Iterable[str] = (), layers: Iterable[int] | None = None, *,
                 query_block: int | None = None, batch: BatchContext | None = None) -> None:
        self.model: nn.Module = model if isinstance(model, nn.Module) else model.model  # a LoadedModel too
        self.edit = {name: dict(writers) for name, writers in (edit or {}).items()}
        self.read = tuple(dict.fromkeys(read))
        self.layers = None if layers is None else set(layers)
        self.query_block, self.batch = query_block, batch
        self.blocked: dict[int, str] = {}
        self._kept: dict[int, dict[str, Any]] = {}
        self._hooks: AbstractContextManager[Any] | None = None
        _check_names(self.edit, self.read)

    def __getitem__(self, layer: int) -> dict[str, Tensor]:
        """What was read at `layer` in the last forward, by point name."""
        if layer not in self._kept:
            raise KeyError(f"nothing was read at layer {layer}")
        return {name: torch.cat(value, dim=2) if name == "pattern" else value
                for name, value in self._kept[layer].items()}

    def __enter__(self) -> Trace:
        self._kept.clear()
        self.blocked.clear()
        hooks = attention_hooks(self.model, self._handlers(), layers=self._chosen_layers(),
                                query_block=self.query_block, batch=self.batch)
        hooks.__enter__()
        self._hooks = hooks
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> bool | None:
        hooks, self._hooks = self._hooks, None
        return None if hooks is None else hooks.__exit__(kind, error, traceback)

    def _chosen_layers(self) -> set[int]:
        """The layers to hook (read and edited), every one checked to exist and to serve its points."""
        found = {layer.index: layer for layer in attention_layers(self.model)}
        reads = set(found) if self.layers is None else self.layers
        wanted = {layer: set(self.read) for layer in reads}
        for name, writers in self.edit.items():
            for layer in writers:
                wanted.setdefault(layer, set()).add(name)
        for index, names in sorted(wanted.items()):
            if index not in found:
                raise ProbeError(f"no attention layer {index}: the model has layers 0 to {len(found) - 1}",
                                 parameter="layers")
            for name in sorted(names):
                if found[index].kind not in POINTS[name].kinds:
                    raise ProbeError(refusal(POINTS[name], found[index].kind, index))
        return set(wanted)

    def _reads_at(self, name: str, layer: int) -> bool:
        return name in self.read and (self.layers is None or layer in self.layers)

    def _handlers(self) -> dict[str, Handler]:
        """One handler per point read or edited (`lse` with its `blocked`)."""
        handlers: dict[str, Handler] = {name: self._handler(name) for name in {*self.edit, *self.read}}
        if "lse" in handlers:
            handlers["lse"], handlers["blocked"] = self._keep_lse, self._note_blocked
        return handlers

    def _handler(self, name: str) -> Handler:
        if name == "pattern":
            return self._keep_block
        writers = self.edit.get(name, {})

        def handle(tensor: Tensor, ctx: HookContext) -> Tensor:
            writer = writers.get(ctx.layer)
            if writer is not None:
                tensor = writer(tensor, ctx)
            if self._reads_at(name, ctx.layer):
                self._kept.setdefault(ctx.layer, {})[name] = tensor.detach().clone()
            return tensor

        return handle

    def _keep_block(self, weights: Tensor, ctx: HookContext) -> None:
        if not self._reads_at("pattern", ctx.layer):
            return
        blocks = self._kept.setdefault(ctx.layer, {})
        if ctx.start == 0:  # a new forward
            blocks["pattern"] = []
        blocks["pattern"].append(weights.detach())  # blocked attention leaves a kept block to its keeper

    def _keep_lse(self, attention: FusedStatistics, ctx: HookContext) -> None:
        if self._reads_at("lse", ctx.layer):
            self._kept.setdefault(ctx.layer, {})["lse"] = attention.lse.detach().clone()

    def _note_blocked(self, reason: str, ctx: HookContext) -> None:
        self.blocked[ctx.layer] = reason


def _check_names(edit: Mapping[str, Mapping[int, Writer]], read: Iterable[str]) -> None:
    """Every point public and known, every edited one writable, and not both `pattern` and `lse`."""
    read = list(read)
    for name in [*edit, *read]:
        point_named(name, public=True)
    for name in edit:
        if not POINTS[name].writable:
            raise ProbeError(f"hook point {name!r} is read-only: put it in `read`, not in `edit`", parameter="edit")
    if "pattern" in read and "lse" in read:
        raise ProbeError("read `pattern` or `lse`, not both: a layer whose log-sum-exp is read runs the fused "
                         "kernel, which computes no weights", parameter="read")

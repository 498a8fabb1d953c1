"""The head editor: a `z` writer for stacked copies of a batch, each copy with its own heads ablated; and
`ablate()`, the context manager that ablates heads for the body of a `with`.

Ablating head h of layer l replaces that head's output (its slice of the input to the layer's output projection,
before the projection) at every position, through the `z` hook point (probe.hooks.points); methods that patch a
head's query, key or value go through the `inputs` point, window ablation through `recompute`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager

import torch
from torch import Tensor, nn

from probe.ablation.heads import Ablation, Head, check_heads, heads_by_layer
from probe.ablation.methods import AblationMethod, InputPatch, method_named
from probe.ablation.statistics import HeadStatistics
from probe.ablation.window import PatternAblation, RestrictedHeads
from probe.hooks.capture import attention_hooks
from probe.hooks.layers import attention_layers
from probe.hooks.points import Writer
from probe.hooks.types import AttentionInputs, HookContext
from probe.errors import ProbeError


def head_editor(ablations: Sequence[Ablation], method: AblationMethod,
                batch: int | None = None) -> tuple[Writer, set[int]]:
    """A `z` writer for `len(ablations)` stacked copies of a batch (the probe set's batch `batch`): copy
    i has ablations[i] replaced by `method`; and the layers it edits."""
    copies, by_layer = len(ablations), heads_by_layer(ablations)
    masks: dict[tuple[int, torch.device], Tensor] = {}

    def edit(heads: Tensor, ctx: HookContext) -> Tensor:  # heads: (copies * batch, positions, n_heads, head_dim)
        layer = ctx.layer
        entries = by_layer.get(layer)
        if not entries:
            return heads
        key = (layer, heads.device)
        if key not in masks:
            mask = torch.zeros(copies, 1, 1, heads.shape[2], 1, dtype=torch.bool)
            for copy, heads_of_copy in entries.items():
                mask[copy, 0, 0, heads_of_copy, 0] = True
            masks[key] = mask.to(heads.device)
        stacked = heads.reshape(copies, heads.shape[0] // copies, *heads.shape[1:])  # (copies, batch, ...)
        if method.per_copy:  # each copy's own values (copies differ once an earlier layer is ablated)
            replacement = torch.stack([method.replacement(layer, copy, batch) for copy in stacked])
        else:
            replacement = method.replacement(layer, stacked[0], batch)
        return torch.where(masks[key], replacement, stacked).reshape(heads.shape)

    return edit, set(by_layer)


def _refuse_non_causal_stacks(model: nn.Module, layers: set[int], method: AblationMethod) -> None:
    """A key window (a KV cache kept while decoding) is defined on causal self-attention: an encoder-decoder's
    encoder and cross-attention layers are refused in one line."""
    found = attention_layers(model)
    other = sorted({found[layer].stack for layer in layers} & {"encoder", "cross"})
    if other:
        raise ProbeError(f"{method.name} ablation restricts a causal head's keys to a decoding cache's; it applies to "
                         f"an encoder-decoder's decoder self-attention (decN.H), not to its {' or '.join(other)} "
                         "layers",
                         parameter="heads")


def inputs_editor(ablations: Sequence[Ablation], method: InputPatch,
                  batch: int | None = None) -> tuple[Callable[[AttentionInputs, HookContext], AttentionInputs],
                                                     set[int]]:
    """An `inputs` handler for `len(ablations)` stacked copies of a batch: copy i has the `method.component` of
    ablations[i]'s heads replaced (a key or value: of their key/value groups); and the layers it edits."""
    copies, by_layer = len(ablations), heads_by_layer(ablations)

    def edit(inputs: AttentionInputs, ctx: HookContext) -> AttentionInputs:
        layer = ctx.layer
        entries = by_layer.get(layer)
        if not entries:
            return inputs
        tensor = getattr(inputs, method.component)  # (copies * batch, heads of this input, positions, head_dim)
        group = inputs.query.shape[1] // tensor.shape[1]  # query heads per key/value head (1 for the query)
        mask = torch.zeros(copies, 1, tensor.shape[1], 1, 1, dtype=torch.bool)
        for copy, heads_of_copy in entries.items():
            mask[copy, 0, sorted({head // group for head in heads_of_copy}), 0, 0] = True
        stacked = tensor.reshape(copies, tensor.shape[0] // copies, *tensor.shape[1:])  # (copies, batch, ...)
        if method.per_copy:  # each copy's own values (a patch at one position keeps the others)
            replacement = torch.stack([method.replacement(layer, copy, batch) for copy in stacked])
        else:
            replacement = method.replacement(layer, stacked[0], batch)
        replaced = torch.where(mask.to(tensor.device), replacement, stacked)
        return dataclasses.replace(inputs, **{method.component: replaced.reshape(tensor.shape)})  # type: ignore[arg-type]

    return edit, set(by_layer)


@contextmanager
def _keys_restricted(model: nn.Module, ablations: Sequence[Ablation], method: AblationMethod,
                     batch: int | None) -> Iterator[None]:
    assert isinstance(method, PatternAblation)
    recompute = RestrictedHeads(ablations, method)
    _refuse_non_causal_stacks(model, recompute.layers, method)
    with attention_hooks(model, layers=recompute.layers, points={"recompute": recompute}):
        yield


@contextmanager
def _inputs_edited(model: nn.Module, ablations: Sequence[Ablation], method: AblationMethod,
                   batch: int | None) -> Iterator[None]:
    assert isinstance(method, InputPatch)
    edit, layers = inputs_editor(ablations, method, batch)
    with attention_hooks(model, layers=layers, points={"inputs": edit}):
        yield


@contextmanager
def _outputs_edited(model: nn.Module, ablations: Sequence[Ablation], method: AblationMethod,
                    batch: int | None) -> Iterator[None]:
    edit, layers = head_editor(ablations, method, batch)
    with attention_hooks(model, layers=layers, points={"z": edit}):
        yield


EDITORS = {"outputs": _outputs_edited, "keys": _keys_restricted, "inputs": _inputs_edited}
"""Where a method acts (`AblationMethod.edits`) -> the hooks that apply it."""


def ablated(model: nn.Module, ablations: Sequence[Ablation], method: AblationMethod,
            batch: int | None = None) -> AbstractContextManager[None]:
    """The stacked copies' heads ablated (see head_editor) for the body of the `with`; restored on exit."""
    return EDITORS[method.edits](model, ablations, method, batch)


@contextmanager
def ablate(model: nn.Module, heads: Iterable[Head], *, method: str | AblationMethod = "zero",
           statistics: HeadStatistics | None = None) -> Iterator[None]:
    """Ablate `heads` together for the body of the `with` (a method of METHODS, built with the reference
    `statistics` it reads, or a method object); restored on exit."""
    chosen = method_named(method, statistics)
    heads = tuple(heads)
    check_heads(attention_layers(model), heads)
    with ablated(model, [heads], chosen):
        yield

"""Hugging Face models whose attention goes through transformers' attention interface (Llama, Gemma, Qwen, GPT-2,
BERT, ...): while hooked, their configs name probe's implementation, `probe_sdpa` or `probe_eager` (after the mask
format it keeps). Layers nobody reads run the model's own implementation; read ones run `blocked_attention`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from torch import Tensor, nn

from probe.hooks.blocked import OnBlock, blocked_attention
from probe.hooks.points import fire_heads, fire_inputs, fire_statistics, fire_weights, fires
from probe.hooks.restore import put_back, restoring
from probe.hooks.transformers_api import (has_implementation, implementation, own_attention, register_attention,
                                          set_implementation, structure_of)
from probe.hooks.types import AttentionInputs, LayerHooks, Undo
from probe.kernels import DEFAULT_CONFIG, AttentionCall, additive_bias, backend_for

SEAT = "_probe_calls"  # an attention module's _Seat while hooked, in its __dict__
RECORDING = "_probe_recording"  # every module's recording list during `recording_layers`, in its __dict__
Recording = list[tuple[nn.Module, int, int, int, int]]


@dataclass(eq=False)
class _Seat:
    """The hooks of each call of one hooked module per forward (ALBERT calls one module as every layer)."""

    by_call: dict[int, LayerHooks] = field(default_factory=dict)
    calls: int = 0

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None  # a copy of a hooked module (QK attribution's copy of a layer) is not hooked


def is_hf_model(model: nn.Module) -> bool:
    """Whether the model has a transformers config whose attention implementation probe can switch."""
    return has_implementation(getattr(model, "config", None))


def _hf_weights_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                          dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                          on_block: OnBlock | None = None, query_block: int | None = None,
                          **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention signature, computed by blocked_attention."""
    output = blocked_attention(
        query, key, value, scaling=scaling, mask=attention_mask, causal=_causal(module, is_causal, attention_mask),
        on_block=on_block, softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"),
        position_bias=kwargs.get("position_bias"), dropout=dropout if module.training else 0.0,
        query_block=query_block,
    )
    return output.transpose(1, 2).contiguous(), None


def _causal(module: nn.Module, is_causal: bool | None, mask: Tensor | None) -> bool:
    """Whether the call is plain causal attention: no mask given and the call (or module) causal."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    return bool(causal) and mask is None


def _from_lse(module: nn.Module, inputs: AttentionInputs, hooks: LayerHooks, kwargs: dict[str, Any]) -> Tensor | None:
    """The fused kernel's output, its statistics handed to `lse`; None (the reason handed to `blocked`) where no
    backend serves the call. A mask noted as padding, causality and a sliding window (transformers_api) goes as a
    (b, kv) key mask and a window; any other as an additive bias, made only once a backend is chosen."""
    query, key, value, mask = inputs.query, inputs.key, inputs.value, inputs.mask
    dropout = kwargs.get("dropout", 0.0) if module.training else 0.0
    structure = structure_of(mask) if inputs.position_bias is None else None
    if structure is not None and tuple(structure.key_mask.shape) == (query.shape[0], key.shape[2]):
        # padding, causal and a sliding window as transformers made them: a (b, kv) key mask and an int
        call = AttentionCall(query, key, value, None, inputs.scaling, structure.causal, inputs.softcap, inputs.sinks,
                             dropout, key_mask=structure.key_mask, window=structure.window)
    else:
        structure = None
        call = AttentionCall(query, key, value, mask if mask is not None else inputs.position_bias, inputs.scaling,
                             _causal(module, kwargs.get("is_causal"), mask), inputs.softcap, inputs.sinks, dropout)
    backend, problem = backend_for(call)
    if backend is None:
        for handler in hooks.of("blocked"):  # why the layer runs the blocked path instead
            handler(problem, hooks.context("blocked"))
        return None
    if structure is None:
        call = replace(call, bias=additive_bias(mask, inputs.position_bias, query.dtype))
    output, attention = backend.run(call, hooks.config or DEFAULT_CONFIG)
    fire_statistics(hooks, attention, inputs)
    return output


def _active_hooks(module: nn.Module) -> LayerHooks | None:
    """The hooks of this call of the module: its calls are counted modulo the calls per forward."""
    seat = module.__dict__.get(SEAT)
    if seat is None:
        return None
    count = seat.calls
    seat.calls = (count + 1) % next(iter(seat.by_call.values())).calls
    return seat.by_call.get(count)


def _inputs(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, kwargs: dict[str, Any]) -> AttentionInputs:
    scaling = kwargs.get("scaling")
    return AttentionInputs(query, key, value, mask, query.shape[-1] ** -0.5 if scaling is None else scaling,
                           kwargs.get("softcap"), kwargs.get("s_aux"), kwargs.get("position_bias"))


def _own_attention(name: str, module: nn.Module, inputs: AttentionInputs, hooks: LayerHooks | None,
                   kwargs: dict[str, Any]) -> Tensor:
    """The layer's attention output (b, n, hq, d): the fused kernel's where `lse` is read, blocked eager attention's
    where the weights are, else the model's own implementation's."""
    tensors = inputs.query, inputs.key, inputs.value, inputs.mask
    if hooks is not None and hooks.of("lse"):
        output = _from_lse(module, inputs, hooks, kwargs)
        if output is not None:
            return output
    if hooks is not None and fires(hooks, "weights"):
        return _hf_weights_attention(module, *tensors, on_block=partial(fire_weights, hooks, inputs=inputs),
                                     query_block=hooks.query_block, **kwargs)[0]
    original = own_attention(name, module) or _hf_weights_attention
    return original(module, *tensors, **kwargs)[0]


def _probe_attention(original_name: str, module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                     attention_mask: Tensor | None, **kwargs: Any) -> tuple[Tensor, Any]:
    """transformers' attention signature: the module's hooks fire, the implementation `original_name` computes what
    no hook replaces; a discovery run records the call (`recording_layers`)."""
    recording = module.__dict__.get(RECORDING)
    if recording is not None:
        recording.append((module, query.shape[1], key.shape[1], query.shape[-1], value.shape[-1]))
    hooks, inputs = _active_hooks(module), _inputs(query, key, value, attention_mask, kwargs)
    if hooks is None:
        return _own_attention(original_name, module, inputs, None, kwargs), None
    if fires(hooks, "inputs"):  # read or replaced queries, keys or values (patching)
        edited = fire_inputs(hooks, inputs)
        inputs = _inputs(edited.query, edited.key, edited.value, attention_mask, kwargs)
    # one `recompute` handler (two recomputations of the same heads would not compose)
    recompute, ctx = (hooks.of("recompute") or [None])[-1], hooks.context("recompute", inputs=inputs)
    heads = inputs.query.shape[1]
    if recompute is not None and not fires(hooks, "weights") and recompute.covers_every_head(hooks.layer, heads):
        output = recompute(None, ctx)  # the layer's own output is not needed
    else:
        output = _own_attention(original_name, module, inputs, hooks, kwargs)
        if recompute is not None:
            output = recompute(output, ctx)
    return fire_heads(hooks, output, inputs), None  # (b, n, hq, d)


IMPLEMENTATIONS = {"probe_sdpa": partial(_probe_attention, "sdpa"), "probe_eager": partial(_probe_attention, "eager")}
"""probe's implementations, named after the mask format each keeps (transformers' sdpa or eager)."""


def switch_implementation(model: nn.Module, undo: list[Undo]) -> None:
    """Switch every config of the model to probe's implementation; `undo` gets the steps that switch back."""
    for name, function in IMPLEMENTATIONS.items():
        register_attention(name, function, masks_of=name.removeprefix("probe_"))
    # every distinct config (a composite model has one per sub-model)
    configs = {id(config): config for module in model.modules()
               if has_implementation(config := getattr(module, "config", None))}
    for config in configs.values():
        current = implementation(config)
        if not (isinstance(current, str) and current.startswith("probe_")):
            keep = "eager" if current == "eager" else "sdpa"  # flash/flex/kernels: sdpa reads the same
            undo.append(set_implementation(config, f"probe_{keep}"))


def _uninstall(seat: _Seat, call: int, previous: LayerHooks | None) -> None:
    if previous is not None:  # an outer `with`'s hooks
        seat.by_call[call] = previous
    else:
        seat.by_call.pop(call, None)


def install_hf(module: nn.Module, hooks: LayerHooks, undo: list[Undo]) -> None:
    """Hook call `hooks.call` of this module (the caller switches the implementation); an outer `with`'s run first."""
    seat = module.__dict__.get(SEAT)
    if seat is None:
        undo.append(partial(put_back, module, SEAT, None))
        seat = module.__dict__[SEAT] = _Seat()
    previous = seat.by_call.get(hooks.call)
    undo.append(partial(_uninstall, seat, hooks.call, previous))
    seat.by_call[hooks.call] = hooks if previous is None else previous.merged(hooks)
    seat.calls = 0


def count_calls_per_forward(model: nn.Module, undo: list[Undo]) -> None:
    """Restart the hooked modules' call counts at every forward, so that a forward cut short cannot shift which call
    is which layer."""
    def restart(_model: nn.Module, _args: Any) -> None:
        for module in model.modules():
            seat = module.__dict__.get(SEAT)
            if seat is not None:
                seat.calls = 0

    undo.append(model.register_forward_pre_hook(restart).remove)


@contextmanager
def recording_layers(model: nn.Module) -> Iterator[Recording]:
    """For the body, probe's implementation runs the model and records (module, query heads, key/value heads,
    head_dim, value head size) of every attention call, in call order."""
    recording: Recording = []
    with restoring() as undo:
        for module in model.modules():
            undo.append(partial(put_back, module, RECORDING, module.__dict__.get(RECORDING)))
            module.__dict__[RECORDING] = recording
        switch_implementation(model, undo)
        yield recording

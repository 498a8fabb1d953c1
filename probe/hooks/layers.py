"""Discovery: a model's attention layers in the order it calls them, found once by a forward on two tokens."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from probe.errors import ProbeError
from probe.hooks.families import family_candidates, family_of, family_shape, is_custom_attention, returns_head_weights
from probe.hooks.hf import is_hf_model, recording_layers
from probe.hooks.restore import restoring
from probe.hooks.run import run_model
from probe.hooks.stacks import is_encoder_decoder, stack_of
from probe.models.hf import encoder_decoder_refusal, refuses_encoder_decoder


@dataclass(frozen=True)
class AttentionLayer:
    """One attention layer, numbered in the order the model calls it."""

    index: int
    module: nn.Module
    kind: str  # "hf", "mha", "custom" or "family"
    n_heads: int  # query heads
    n_kv_heads: int
    head_dim: int
    call: int = 0  # which call of `module` this layer is: ALBERT runs one attention module as every layer
    calls: int = 1  # how many times the model calls `module` per forward
    stack: str = ""  # encoder-decoders: "encoder", "decoder" or "cross" (probe.hooks.stacks); else ""
    in_stack: int = 0  # the layer's index within its stack (encoder-decoders)
    value_dim: int = 0  # size of a value head, the head outputs' width: head_dim unless smaller (DeepSeek's MLA)

    def __post_init__(self) -> None:
        if not self.value_dim:
            object.__setattr__(self, "value_dim", self.head_dim)


_LAYERS: weakref.WeakKeyDictionary[nn.Module, list[AttentionLayer]] = weakref.WeakKeyDictionary()


def _first_calls(calls: list[tuple[nn.Module, Any]]) -> list[tuple[nn.Module, Any]]:
    """Each module's first call, in call order."""
    first: dict[int, tuple[nn.Module, Any]] = {}
    for module, detail in calls:
        first.setdefault(id(module), (module, detail))
    return list(first.values())


def _two_tokens(model: nn.Module) -> None:
    """The forward that discovery watches, on token ids (1, 2); the model's failure as one ProbeError."""
    try:
        with torch.no_grad():
            run_model(model, torch.zeros(1, 2, dtype=torch.long))
    except Exception as error:
        raise ProbeError(f"the model's forward failed on token ids (1, 2): {type(error).__name__}: {error}") from error


def _hf_layers(model: nn.Module) -> list[AttentionLayer]:
    """Layers by call: a module the model calls k times (ALBERT shares one across its layers) is k layers."""
    with recording_layers(model) as recording:
        _two_tokens(model)
    modules = [module for module, *_ in recording]
    layers = []
    for index, (module, heads, kv_heads, head_dim, value_dim) in enumerate(recording):
        call = sum(other is module for other in modules[:index])
        calls = sum(other is module for other in modules)
        layers.append(AttentionLayer(index, module, "hf", heads, kv_heads, head_dim, call=call, calls=calls,
                                     value_dim=value_dim))
    if is_encoder_decoder(model):  # T5, BART: encoder, decoder self- and cross-attention, each numbered from 0
        stacks = [stack_of(model, layer.module) for layer in layers]
        layers = [replace(layer, stack=stack, in_stack=stacks[:flat].count(stack))
                  for flat, (layer, stack) in enumerate(zip(layers, stacks))]
    return layers


def _called_in_order(model: nn.Module, candidates: list[nn.Module]) -> list[tuple[nn.Module, Any]]:
    """(module, output) of each call of the candidates on token ids (1, 2), in call order."""
    calls: list[tuple[nn.Module, Any]] = []
    with restoring() as undo:
        for candidate in candidates:
            undo.append(candidate.register_forward_hook(lambda mod, _i, out: calls.append((mod, out))).remove)
        _two_tokens(model)
    return calls


def _module_layers(model: nn.Module) -> list[AttentionLayer]:
    """nn.MultiheadAttention and textbook modules that return (output, weights (b, num_heads, n, kv))."""
    candidates = [m for m in model.modules() if isinstance(m, nn.MultiheadAttention) or is_custom_attention(m)]
    calls = _called_in_order(model, candidates)
    layers: list[AttentionLayer] = []
    for module, output in _first_calls(calls):
        heads: Any = module.num_heads  # an int the module sets
        if isinstance(module, nn.MultiheadAttention):
            layers.append(AttentionLayer(len(layers), module, "mha", heads, heads, int(module.embed_dim) // heads))
        elif returns_head_weights(module, output):
            head_dim = int(output[0].shape[-1]) // heads if isinstance(output[0], torch.Tensor) else 0
            layers.append(AttentionLayer(len(layers), module, "custom", heads, heads, head_dim))
    return layers


def attention_layers(model: nn.Module) -> list[AttentionLayer]:
    """The model's attention layers in call order, found once by a forward pass on two tokens and remembered."""
    if model in _LAYERS:
        return _LAYERS[model]
    config = getattr(model, "config", None)
    if config is not None and refuses_encoder_decoder(config):
        raise ProbeError(encoder_decoder_refusal(config.model_type))
    family = family_of(model)
    if family is not None:
        calls = _first_calls(_called_in_order(model, family_candidates(model, family)))
        layers = [AttentionLayer(index, module, "family", *family_shape(module)) for index, (module, _) in
                  enumerate(calls)]
    else:
        layers = _hf_layers(model) if is_hf_model(model) else _module_layers(model)
    if not layers:
        raise ProbeError(f"no attention layers found in {type(model).__name__}: probe reads Hugging Face models "
                         "that use transformers' attention interface or are in probe.hooks.families, "
                         "nn.MultiheadAttention, and modules with num_heads and W_o/out_proj/o_proj that return "
                         "(output, attention_weights)")
    _LAYERS[model] = layers
    return layers

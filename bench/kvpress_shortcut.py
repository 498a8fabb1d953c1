"""One prefill, every kvpress press: the cache each press would leave, without prefilling once per press.

kvpress applies a press in a forward hook after each attention layer (`BasePress.forward_hook`, kvpress 0.5.5): the
layer first attends over its full keys, then the hook replaces that layer's cache entry with the compressed one (or,
for DuoAttentionPress, records which keys later calls must not see). The layer's output, and so every later layer's
input, is the same with or without a press. So one plain prefill, with each attention layer's call (its keyword
arguments: hidden states, position embeddings, cache position) and the full cache recorded, gives every press what
its hooks would get: `apply` hands that record to the press's own `forward_hook`, layer by layer in order, on a copy
of the full cache, inside the press's own context manager (which runs `post_init_from_model`). The question and the
greedy answer then go through kvpress's pipeline's own `generate_answer`. tests/test_kvpress_bench.py checks, press by
press, that the cache and the answer equal those of kvpress's pipeline (`_forward`, a prefill under the press).

Nothing of a press is written here: only kvpress's code compresses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache


@dataclass
class Prefill:
    """A plain prefill of one context: per attention layer its module, the keyword arguments it was called with
    (the cache left out) and its attention weights (None under SDPA), and the full cache's keys and values."""

    context_length: int
    calls: list[tuple[torch.nn.Module, dict[str, Any], Any]]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


def attention_modules(model: Any) -> list[torch.nn.Module]:
    """The attention modules kvpress hooks (`BasePress.__call__`: `model.model.layers[i].self_attn`)."""
    language = model.model.language_model if hasattr(model.model, "language_model") else model.model
    return [layer.self_attn for layer in language.layers]


def prefill(model: Any, context_ids: torch.Tensor) -> Prefill:
    """Prefill `context_ids` (1, n) once, as kvpress's pipeline does (`model.model(input_ids, past_key_values)`, no
    LM head), recording every attention layer's call."""
    calls: list[tuple[torch.nn.Module, dict[str, Any], Any]] = []

    def record(module: torch.nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        kept = {name: value for name, value in kwargs.items() if name != "past_key_values"}
        calls.append((module, kept, (None, output[1])))  # forward_hook reads output[1] (attentions) only

    handles = [module.register_forward_hook(record, with_kwargs=True) for module in attention_modules(model)]
    cache = DynamicCache()
    try:
        with torch.no_grad():
            model.model(input_ids=context_ids, past_key_values=cache)
    finally:
        for handle in handles:
            handle.remove()
    return Prefill(int(context_ids.shape[1]), calls, [layer.keys for layer in cache.layers],
                   [layer.values for layer in cache.layers])


def full_cache(record: Prefill) -> DynamicCache:
    """A copy of the uncompressed cache the prefill left."""
    cache = DynamicCache()
    for index, (keys, values) in enumerate(zip(record.keys, record.values)):
        cache.update(keys.clone(), values.clone(), index)
    return cache


def apply(press: Any, model: Any, record: Prefill) -> DynamicCache:
    """The cache `press` leaves after the prefill `record` (None: no press, the full cache): the press's own
    `forward_hook` called with each layer's recorded call, in layer order, inside `press(model)`. Head masks a
    DuoAttentionPress left on the modules are cleared first, as a prefill clears them (kvpress's attention patch)."""
    cache = full_cache(record)
    for module in attention_modules(model):
        module.masked_key_indices = None
    if press is None:
        return cache
    with torch.no_grad(), press(model):
        for module, kwargs, output in record.calls:
            press.forward_hook(module, [], {**kwargs, "past_key_values": cache}, output)
    return cache


def answer(pipe: Any, question_ids: torch.Tensor, cache: DynamicCache, context_length: int,
           max_new_tokens: int) -> str:
    """The pipeline's own greedy answer to `question_ids` after the (compressed) context in `cache`."""
    with torch.no_grad():
        return str(pipe.generate_answer(question_ids=question_ids, cache=cache, context_length=context_length,
                                        max_new_tokens=max_new_tokens))


def continuation_loss(model: Any, cache: DynamicCache, context_length: int,
                      continuation: torch.Tensor) -> tuple[float, int]:
    """(summed cross-entropy, tokens) of `continuation` (1, m) read after the context in `cache`, in one forward with
    positions from `context_length` on, as the pipeline reads a question (the press is not active: kvpress compresses
    the prefill only); token i + 1 predicted from token i, so the prefill's own last prediction is left out."""
    positions = torch.arange(context_length, context_length + continuation.shape[1]).unsqueeze(0)
    with torch.no_grad():
        logits = model(input_ids=continuation, past_key_values=cache, position_ids=positions).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], continuation[0, 1:], reduction="sum")
    return float(loss), int(continuation.shape[1] - 1)


def removed_fraction(press: Any, model: Any, cache: DynamicCache, context_length: int) -> float:
    """The fraction of the context's cache entries (layers x KV heads x tokens) the press removed, counted: entries
    dropped from the cache, plus those DuoAttentionPress masks (`masked_key_indices`) and keeps in memory."""
    modules = attention_modules(model)
    heads = cache.layers[0].keys.shape[1]
    total = len(modules) * heads * context_length
    kept = sum(int(layer.keys.shape[2]) * heads for layer in cache.layers)
    masked = sum(len(found[0]) for module in modules
                 if (found := getattr(module, "masked_key_indices", None)) is not None)
    return (total - kept + masked) / total

"""bench/kvpress.py's shortcut is exact: one plain prefill, then each press's own forward hook run on a copy of the
cache (bench/kvpress_shortcut.py), leaves the cache, the head masks and the answer that kvpress's own context
manager and pipeline leave when the context is prefilled under that press. All presses are applied from one prefill,
in turn, so a press that left state on the model (DuoAttentionPress's masks) would show. Runs where kvpress is
installed (.ci/compat makes that environment) and is skipped elsewhere."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

kvpress = pytest.importorskip("kvpress", reason="kvpress is not installed here (.ci/compat makes its own venv)")

from transformers import DynamicCache, pipeline  # noqa: E402

from bench.kvpress_shortcut import answer, apply, attention_modules, prefill  # noqa: E402
from conftest import tiny_hf  # noqa: E402
from planted_syntax import syntax_tokenizer  # noqa: E402


def _presses(layers: int, kv_heads: int, sink: int, recent: int, fraction: float) -> dict[str, Any]:
    scores = np.random.default_rng(0).random((layers, kv_heads))
    duo = kvpress.DuoAttentionPress(head_compression_ratio=0.5)
    duo.load_attention_pattern = lambda model: (sink, recent, scores)
    return {"DuoAttention": duo, "StreamingLLM": kvpress.StreamingLLMPress(compression_ratio=fraction),
            "SnapKV": kvpress.SnapKVPress(compression_ratio=fraction),
            "ExpectedAttention": kvpress.ExpectedAttentionPress(compression_ratio=fraction),
            "Knorm": kvpress.KnormPress(compression_ratio=fraction)}


def _masks(model: Any) -> list[Any]:
    return [None if (found := getattr(module, "masked_key_indices", None)) is None
            else [index.clone() for index in found] for module in attention_modules(model)]


def _reference(model: Any, pipe: Any, press: Any, context: torch.Tensor, question: torch.Tensor,
               tokens: int) -> tuple[DynamicCache, list[Any], str]:
    """kvpress's own way: the context prefilled under the press's context manager (the cache and masks it leaves),
    and the pipeline's `_forward` (its prefill under the press, then the greedy answer)."""
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model.model(input_ids=context, past_key_values=cache)
    masks = _masks(model)
    with torch.no_grad():
        text = pipe._forward({"context_ids": context, "questions_ids": [question]}, max_new_tokens=tokens,
                             press=press)[0]
    return cache, masks, text


def _check(model: Any, tokenizer: Any, contexts: list[torch.Tensor], question: torch.Tensor, sink: int,
           recent: int) -> None:
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    for context in contexts:
        record = prefill(model, context)
        n = context.shape[1]
        presses = _presses(layers, kv_heads, sink, recent, 0.6)
        shortcut = {}
        for name, press in presses.items():  # every press from the one prefill, in turn
            cache = apply(press, model, record)
            # before the answer: kvpress's attention patch writes its fake keys into the cache it reads
            kept = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
            masks = _masks(model)
            shortcut[name] = (kept, masks, answer(pipe, question, cache, n, 5), press.compression_ratio)
        for name, press in _presses(layers, kv_heads, sink, recent, 0.6).items():
            cache, masks, text = _reference(model, pipe, press, context, question, 5)
            mine, my_masks, my_text, my_ratio = shortcut[name]
            compressed = any(layer.keys.shape[2] < n for layer in cache.layers) or any(m is not None for m in masks)
            assert compressed, f"{name} left the cache whole: the comparison would prove nothing"
            assert len(cache.layers) == len(mine)
            for layer, (theirs, (keys, values)) in enumerate(zip(cache.layers, mine)):
                assert torch.equal(theirs.keys, keys) and torch.equal(theirs.values, values), (name, layer)
            for theirs_mask, our_mask in zip(masks, my_masks):
                assert (theirs_mask is None) == (our_mask is None), name
                if theirs_mask is not None:
                    assert all(torch.equal(a, b) for a, b in zip(theirs_mask, our_mask)), name
            assert my_text == text, (name, my_text, text)
            assert my_ratio == press.compression_ratio, name


def test_shortcut_equals_kvpress_on_a_tiny_llama() -> None:
    model = tiny_hf("llama_gqa", max_position_embeddings=1024)  # 2 layers, 4 query heads on 2 KV heads
    generator = torch.Generator().manual_seed(0)
    contexts = [torch.randint(5, 120, (1, 96 + 8 * i), generator=generator) for i in range(3)]
    question = torch.randint(5, 120, (1, 6), generator=generator)
    _check(model, syntax_tokenizer(), contexts, question, sink=4, recent=8)


def test_shortcut_equals_kvpress_on_smollm2(smollm2) -> None:
    from bench.kvpress import needle_units

    tokenizer = smollm2.tokenizer
    template, tokenizer.chat_template = tokenizer.chat_template, None
    try:
        units = list(needle_units(smollm2, 512, 1))[:2]
        _check(smollm2.model, tokenizer, [unit[3] for unit in units], units[0][4], sink=64, recent=256)
    finally:
        tokenizer.chat_template = template

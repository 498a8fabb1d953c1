"""The structure probe notes on the masks transformers makes for `probe_sdpa` (probe.hooks.transformers_api,
from the mask function's arguments): where noted, the key mask, causality and window stand for
exactly the mask transformers made; where the mask is something else (packed sequences, a cache), nothing is noted.
Run with the newest transformers and with the floor (.ci/compat)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import tiny_hf

from probe.hooks.capture import attention_hooks
from probe.hooks.transformers_api import MaskStructure, structure_of
from probe.hooks.types import AttentionInputs, HookContext


def _masks(model: torch.nn.Module, **inputs: Any) -> list[torch.Tensor | None]:
    """The mask each attention layer got, in layer order, from one forward under probe's implementation."""
    seen: list[torch.Tensor | None] = []

    def keep(attention: AttentionInputs, _ctx: HookContext) -> AttentionInputs:
        seen.append(attention.mask)
        return attention

    with torch.no_grad(), attention_hooks(model, points={"inputs": keep}):
        model(**inputs)
    return seen


def _dense(structure: MaskStructure, n: int) -> torch.Tensor:
    """The (b, 1, n, kv) boolean mask a structure stands for."""
    kv = structure.key_mask.shape[1]
    distance = torch.arange(n)[:, None] - torch.arange(kv)[None, :]
    seen = structure.key_mask[:, None, None, :].expand(-1, 1, n, kv).clone()
    if structure.causal:
        seen &= distance >= 0
    if structure.window is not None:
        seen &= distance < structure.window
    return seen


def _gemma3() -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.Gemma3TextConfig(vocab_size=120, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 max_position_embeddings=256, sliding_window=5,
                                 layer_types=["sliding_attention", "full_attention"])
    return tf.Gemma3ForCausalLM(config).eval()


PADDED = torch.tensor([[0] * 3 + [1] * 9, [1] * 12])  # one row left-padded by 3


@pytest.mark.parametrize(("name", "causal", "windows"), [
    ("llama_gqa", True, [None, None]), ("bert", False, [None, None]), ("gemma3", True, [5, None])])
def test_a_noted_structure_is_the_mask_transformers_made(name: str, causal: bool, windows: list[int | None]) -> None:
    model = _gemma3() if name == "gemma3" else tiny_hf(name)
    ids = torch.randint(1, 120, (2, 12))
    masks = _masks(model, input_ids=ids, attention_mask=PADDED)
    assert len(masks) == len(windows)
    for mask, window in zip(masks, windows):
        structure = structure_of(mask)
        assert mask is not None and structure is not None
        assert (structure.causal, structure.window) == (causal, window)
        assert torch.equal(structure.key_mask, PADDED.bool())
        assert torch.equal(_dense(structure, 12), mask)


def test_packed_sequences_and_a_cache_are_not_noted() -> None:
    model = tiny_hf("llama_gqa")
    ids = torch.randint(1, 120, (1, 12))
    packed = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]])  # three sequences in one row: a block mask
    masks = _masks(model, input_ids=ids, position_ids=packed, use_cache=False)
    assert all(mask is not None and structure_of(mask) is None for mask in masks)
    with torch.no_grad():
        cache = model(input_ids=ids, attention_mask=torch.ones(1, 12, dtype=torch.long), use_cache=True).past_key_values
    masks = _masks(model, input_ids=ids[:, :2], attention_mask=torch.ones(1, 14, dtype=torch.long),
                   past_key_values=cache)
    assert all(structure_of(mask) is None for mask in masks)

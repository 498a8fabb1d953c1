"""Captured attention equals the model's own eager attention, and capturing leaves the model unchanged."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_hf, tiny_loaded

from probe.attention import attention_hooks, attention_layers, capture_attention, logits_of, run_model
from probe.classify import score_heads
from probe.data import ProbeSet
from probe.scores import SCORES

ARCHITECTURES = ["llama_gqa", "llama_mqa", "qwen2", "mistral", "gemma2", "gpt2", "gpt_bigcode", "bert"]


def eager_reference(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None):
    """The model's own eager attention via output_attentions, switched to eager and back."""
    saved = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            output = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    finally:
        model.set_attn_implementation(saved)
    return output


@pytest.mark.parametrize("kind", ARCHITECTURES)
@pytest.mark.parametrize("padded", [False, True])
def test_capture_equals_eager(kind: str, padded: bool) -> None:
    model = tiny_hf(kind)
    torch.manual_seed(1)
    ids = torch.randint(1, 120, (3, 17))
    mask = None
    if padded:
        mask = torch.ones_like(ids)
        mask[1, 12:] = 0
        mask[2, 5:] = 0
    reference = eager_reference(model, ids, mask)
    before = model.config._attn_implementation
    patterns = capture_attention(model, ids, mask, query_block=4)  # several query blocks per layer
    assert model.config._attn_implementation == before
    assert sorted(patterns) == list(range(model.config.num_hidden_layers))
    n_heads = model.config.num_attention_heads
    for layer, pattern in patterns.items():
        assert pattern.shape == (3, n_heads, 17, 17)  # query heads, also under grouped/multi-query attention
        expected = reference.attentions[layer]
        valid = torch.ones(3, 17, dtype=torch.bool) if mask is None else mask.bool()
        rows = valid[:, None, :, None].expand_as(pattern)  # padded query rows are not attention of any token
        assert (pattern - expected).abs()[rows].max() <= 1e-5


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_capture_leaves_outputs_and_model_unchanged(kind: str) -> None:
    model = tiny_hf(kind)
    ids = torch.randint(1, 120, (2, 11))
    with torch.no_grad():
        before = logits_of(run_model(model, ids))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    seen = []
    with torch.no_grad(), attention_hooks(model, on_weights=lambda layer, start, w: seen.append(layer)):
        during = logits_of(run_model(model, ids))
    with torch.no_grad():
        after = logits_of(run_model(model, ids))
    assert seen == list(range(model.config.num_hidden_layers))
    assert (during - before).abs().max() <= 1e-5
    assert torch.equal(after, before)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_hooks_restored_after_error() -> None:
    model = tiny_hf("llama_gqa")
    before = model.config._attn_implementation

    def fail(layer, start, weights):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"), attention_hooks(model, on_weights=fail):
        run_model(model, torch.randint(1, 120, (1, 5)))
    assert model.config._attn_implementation == before
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_blocked_equals_unblocked_scores() -> None:
    loaded = tiny_loaded("llama_gqa")
    ids = torch.randint(1, 120, (4, 40))
    probe_set = ProbeSet("natural", "test", ids, offset=1)
    names = [name for name, score in SCORES.items() if score.probe == "natural"]
    whole = score_heads(loaded, probe_set, names)
    blocked = score_heads(loaded, probe_set, names, query_block=3)
    for name in names:
        assert torch.allclose(whole[name], blocked[name], atol=1e-6)


@pytest.mark.parametrize("kind", ["llama_gqa", "bert"])
def test_padded_batch_scores_equal_one_by_one(kind: str) -> None:
    """Scores pool (sequence, query) pairs; a padded batch must pool exactly what its sequences give alone."""
    loaded = tiny_loaded(kind)
    torch.manual_seed(2)
    ids = torch.randint(1, 120, (3, 30))
    mask = torch.ones_like(ids)
    mask[1, 21:] = 0
    mask[2, 9:] = 0
    padded = ProbeSet("natural", "test", ids, offset=1, attention_mask=mask)
    names = [name for name, score in SCORES.items() if score.probe == "natural"]
    batched = score_heads(loaded, padded, names, batch_size=3)
    one_by_one = score_heads(loaded, padded, names, batch_size=1)  # each batch is cut to its real length
    for name in names:
        assert torch.allclose(batched[name], one_by_one[name], atol=1e-5), name


def test_layers_found_in_call_order() -> None:
    model = tiny_hf("gpt2")
    layers = attention_layers(model)
    assert [layer.module for layer in layers] == [block.attn for block in model.transformer.h]
    assert all(layer.kind == "hf" and layer.n_heads == 4 for layer in layers)
    mqa = attention_layers(tiny_hf("llama_mqa"))
    assert [(layer.n_heads, layer.n_kv_heads) for layer in mqa] == [(4, 1), (4, 1)]

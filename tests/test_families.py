"""Every family probe reads, as a tiny random model: captured attention equals the model's own eager
`output_attentions`, ablation equals zeroing the head's slice of the output projection's input (a pre-hook written
here, on a projection named by hand), the exact sweep (prefix reuse) equals the naive loop, and the model is unchanged
afterwards. What probe refuses, it refuses in one line; encoder-decoders are in
tests/test_encoder_decoder.py."""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from families import ADAPTED, FAMILY_MODELS, PROJECTIONS, pre_hooks, tiny_family, zero_head_slices

from probe.ablation import ablate, sweep
from probe.hooks.capture import attention_hooks, capture_attention
from probe.hooks.layers import attention_layers
from probe.hooks.run import logits_of, run_model
from probe.inputs import ProbeSet
from probe.errors import ProbeError
from probe.models import LoadedModel, load_model


@contextmanager
def eager(model: torch.nn.Module):
    """Every config of the model on eager for the body. Set directly: Falcon's set_attn_implementation("eager") keeps
    sdpa, and its output_attentions then adds sdpa's boolean mask as numbers (transformers 5)."""
    configs = {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None),
                                                                          "_attn_implementation_internal")}
    saved = {key: config._attn_implementation_internal for key, config in configs.items()}
    for config in configs.values():
        config._attn_implementation_internal = "eager"
    try:
        yield
    finally:
        for key, config in configs.items():
            config._attn_implementation_internal = saved[key]


def snapshot(model: torch.nn.Module) -> tuple[dict, list]:
    """The weights, and every hook, forward override and attention implementation, to compare after."""
    state = {key: value.clone() for key, value in model.state_dict().items()}
    hooks = [(name, len(m._forward_hooks), len(m._forward_pre_hooks), "forward" in m.__dict__,
              getattr(getattr(m, "config", None), "_attn_implementation_internal", None))
             for name, m in model.named_modules()]
    return state, hooks


def assert_unchanged(model: torch.nn.Module, before: tuple[dict, list]) -> None:
    state, hooks = snapshot(model)
    assert hooks == before[1]
    assert state.keys() == before[0].keys() and all(torch.equal(state[k], before[0][k]) for k in state)


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_capture_equals_eager_output_attentions(name: str) -> None:
    model = tiny_family(name)
    torch.manual_seed(1)
    ids = torch.randint(1, 120, (3, 13))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    mask[2, 4:] = 0
    with eager(model), torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    before = snapshot(model)
    patterns = capture_attention(model, ids, mask, query_block=4)
    assert_unchanged(model, before)
    assert sorted(patterns) == list(range(len(reference))) == [layer.index for layer in attention_layers(model)]
    rows = mask.bool()[:, None, :, None]  # padded query rows are no token's attention
    for layer, pattern in patterns.items():
        assert pattern.shape == (3, 4, 13, 13)
        assert (pattern - reference[layer]).abs().masked_select(rows).max() <= 1e-5, (name, layer)
    if name in ADAPTED:  # causal: no weight on a later key
        assert patterns[0].triu(1).abs().max() == 0


@contextmanager
def projection_input_zeroed(model: torch.nn.Module, name: str, heads: list[tuple[int, int]], head_dim: int):
    """The reference ablation: zero head h's slice of layer l's output projection input, by a pre-hook. A projection
    shared by several layers (ALBERT) counts its calls: call i of a forward belongs to the i-th layer using it."""
    n_layers = len(attention_layers(model))
    projections = [model.get_submodule(PROJECTIONS[name].format(layer)) for layer in range(n_layers)]
    hooks = []
    for projection in {id(p): p for p in projections}.values():
        layers = [layer for layer in range(n_layers) if projections[layer] is projection]
        calls = [0]

        def zero(_module, args, layers=layers, calls=calls):
            layer = layers[calls[0] % len(layers)]
            calls[0] += 1
            return zero_head_slices(args, [h for at, h in heads if at == layer], head_dim)

        hooks.append((projection, zero))
    with pre_hooks(hooks):
        yield


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_ablation_equals_zeroed_projection_input(name: str) -> None:
    model = tiny_family(name)
    ids = torch.randint(1, 120, (2, 11))
    heads = [(0, 1), (1, 3)]
    with torch.no_grad():
        baseline = logits_of(run_model(model, ids))
        with projection_input_zeroed(model, name, heads, attention_layers(model)[0].value_dim):
            reference = logits_of(run_model(model, ids))
    before = snapshot(model)
    with torch.no_grad(), ablate(model, heads):
        ablated = logits_of(run_model(model, ids))
    assert_unchanged(model, before)
    assert (reference - baseline).abs().max() > 1e-3  # the reference does change the output
    assert (ablated - reference).abs().max() <= 1e-5
    with torch.no_grad():
        assert torch.equal(logits_of(run_model(model, ids)), baseline)


@pytest.mark.parametrize("name", [*ADAPTED, "albert"])
def test_exact_sweep_reuses_the_prefix_and_equals_the_naive_loop(name: str) -> None:
    model = tiny_family(name)
    loaded = LoadedModel(model=model, tokenizer=None, name=name, vocab_size=120)
    torch.manual_seed(3)
    probe_set = ProbeSet("natural", "test", torch.randint(1, 120, (3, 9)), offset=1)
    before = snapshot(model)
    naive = sweep(loaded, probe_set, mode="naive", batch_size=2)
    exact = sweep(loaded, probe_set, mode="exact", batch_size=2, stack=3)
    assert_unchanged(model, before)
    assert naive.path.startswith("naive")
    if name == "albert":  # one block, run as every layer: nothing to reuse, the naive loop, said so
        assert exact.path.startswith("naive") and "more than once" in exact.path
    else:
        assert exact.path.startswith("exact")
    assert [r.heads for r in exact.results] == [r.heads for r in naive.results]
    assert len(exact.results) == 4 * len(attention_layers(model))
    for a, b in zip(exact.results, naive.results):
        assert a.loss == pytest.approx(b.loss, abs=1e-5)


@pytest.mark.parametrize("name", ["gemma3n", "deepseek_v2", "deepseek_v3"])
def test_the_exact_sweep_on_models_of_their_own_shape_equals_the_naive_loop_without_falling_back(name: str) -> None:
    """Gemma-3n: AltUp's block outputs carry (predictions, batch, ...), stacked along their batch axis; its
    KV-shared layers read keys and values that layers 2 and 3 store during the forward, so their runs start at
    block 2 (declared by the layers, not found by a failing check). DeepSeek: value heads of their own size."""
    from probe.ablation.blocks import find_blocks

    model = tiny_family(name)
    loaded = LoadedModel(model=model, tokenizer=None, name=name, vocab_size=120)
    torch.manual_seed(3)
    probe_set = ProbeSet("natural", "test", torch.randint(1, 120, (3, 12)), offset=1)
    blocks, _ = find_blocks(model, attention_layers(model))
    assert blocks is not None
    n_layers = len(attention_layers(model))
    starts = [blocks.start_of(layer) for layer in range(n_layers)]
    assert starts == ([0, 1, 2, 2, 2, 2] if name == "gemma3n" else [0, 1])
    before = snapshot(model)
    naive = sweep(loaded, probe_set, mode="naive", batch_size=2)
    exact = sweep(loaded, probe_set, mode="exact", batch_size=2, stack=3)
    assert_unchanged(model, before)
    assert exact.path.startswith("exact"), exact.path
    assert [r.heads for r in exact.results] == [r.heads for r in naive.results]
    assert len(exact.results) == 4 * n_layers
    for a, b in zip(exact.results, naive.results):
        assert a.loss == pytest.approx(b.loss, abs=1e-5)
    assert max(abs(r.delta) for r in exact.results) > 1e-4


def test_gemma3n_exact_sweep_with_chunked_logits_equals_the_naive_loop(monkeypatch) -> None:
    """Long context on Gemma-3n: the loss read from the last block's output, (predictions, batch, positions,
    hidden), its rows taken along the batch axis."""
    from probe.ablation import blocks as readouts

    loaded = LoadedModel(model=tiny_family("gemma3n"), tokenizer=None, name="gemma3n", vocab_size=120)
    torch.manual_seed(3)
    probe_set = ProbeSet("natural", "test", torch.randint(1, 120, (3, 12)), offset=1)
    heads = [(0, 1), (2, 0), (3, 3), (5, 2)]
    naive = sweep(loaded, probe_set, heads, mode="naive", batch_size=2)
    monkeypatch.setattr(readouts, "LOGITS_BYTES", 0)
    exact = sweep(loaded, probe_set, heads, mode="exact", batch_size=2, stack=2)
    assert exact.path.startswith("exact"), exact.path
    for a, b in zip(exact.results, naive.results):
        assert a.heads == b.heads and a.loss == pytest.approx(b.loss, abs=1e-5)


def test_bloom_that_bypasses_its_projection_is_refused_when_editing() -> None:
    model = tiny_family("bloom")
    for module in model.modules():
        if type(module).__name__ == "BloomAttention":
            module.pretraining_tp, module.slow_but_exact = 2, True
    before = snapshot(model)
    assert sorted(capture_attention(model, torch.randint(1, 120, (1, 5)))) == [0, 1]  # reading still works
    with pytest.raises(ProbeError, match="slow_but_exact"), ablate(model, [(0, 1)]):
        pass
    assert_unchanged(model, before)


def test_a_shared_attention_module_is_one_layer_per_call() -> None:
    """ALBERT runs one attention module as each of its layers: probe numbers layers by call."""
    model = tiny_family("albert")
    layers = attention_layers(model)
    assert [(layer.index, layer.call, layer.calls) for layer in layers] == [(0, 0, 3), (1, 1, 3), (2, 2, 3)]
    assert len({id(layer.module) for layer in layers}) == 1
    ids = torch.randint(1, 120, (1, 6))
    only_last = capture_attention(model, ids, layers={2})
    assert sorted(only_last) == [2]
    every = capture_attention(model, ids)
    assert (only_last[2] - every[2]).abs().max() <= 1e-6  # the other layers ran sdpa or eager
    assert (only_last[2] - every[0]).abs().max() > 1e-4  # the third call's weights, not the first's
    seen: list[int] = []

    def fail_once(weights: torch.Tensor, ctx) -> None:
        seen.append(ctx.layer)
        if seen == [0]:
            raise RuntimeError("cut short")

    with torch.no_grad(), attention_hooks(model, {"pattern": fail_once}):  # a forward cut short, then a whole one
        with pytest.raises(RuntimeError, match="cut short"):
            run_model(model, ids)
        run_model(model, ids)
    assert seen == [0, 0, 1, 2]


def test_a_placeholder_tokenizer_falls_back_to_random_tokens(tmp_path: Path) -> None:
    """A folder without tokenizer files: transformers builds a near-empty tokenizer that encodes no text."""
    from probe.inputs import ProbeOptions, build_probe_set

    tiny_family("gpt2").save_pretrained(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_model(str(tmp_path))
    assert loaded.tokenizer is None
    assert any("cannot encode text" in str(warning.message) for warning in caught)
    probe_set = build_probe_set("natural", loaded, ProbeOptions(seq_len=16, num_seqs=2))
    assert "random tokens" in probe_set.description
    assert len(set(probe_set.input_ids.flatten().tolist())) > 8  # real random ids, not one [UNK] repeated


def test_a_family_built_with_flash_attention_is_refused_in_one_line() -> None:
    from transformers.models.gpt_neo.modeling_gpt_neo import GPTNeoFlashAttention2

    model = tiny_family("gpt_neo")
    for block in model.transformer.h:  # as from_pretrained(..., attn_implementation="flash_attention_2") builds it
        block.attn.attention.__class__ = GPTNeoFlashAttention2
    with pytest.raises(ProbeError, match="built with GPTNeoFlashAttention2.*attn_implementation='eager'"):
        attention_layers(model)

"""Value heads of their own size: DeepSeek V2 / V3's multi-head latent attention (value heads of 16 against query/key
heads of 24, and of 12 against 16, so that heads x value size is not the hidden size) through sweeps, patching,
direct logit attribution, weight-based circuits, classify and the CLI, each checked against a computation written
here on the model's own modules. Capture and ablation are tests/test_families.py's (DeepSeek is in FAMILY_MODELS)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import run_cli
from families import tiny_family
from test_dla import random_contrast
from test_patching import projection_patched_loss
from test_specific import swapped_loss

from probe.ablation import sweep
from probe.ablation.methods import PatchAblation, patch_method
from probe.ablation.statistics import head_outputs
from probe.hooks.capture import attention_hooks
from probe.hooks.layers import attention_layers
from probe.hooks.run import run_model
from probe.circuits import layer_weights
from probe.dla import logit_attribution
from probe.errors import ProbeError
from probe.heads.classify import score_heads
from probe.inputs import ProbeSet
from probe.models import LoadedModel

MLA = ["deepseek_v2", "deepseek_v3"]
SIZES = {"deepseek_v2": (24, 16, 16), "deepseek_v3": (16, 12, 8)}  # query/key head, value head, no-rotary part


def _loaded(name: str) -> LoadedModel:
    return LoadedModel(model=tiny_family(name), tokenizer=None, name=name, vocab_size=120)


def _random_set(seed: int, rows: int = 4, length: int = 10) -> ProbeSet:
    generator = torch.Generator().manual_seed(seed)
    return ProbeSet("natural", "random ids", torch.randint(1, 120, (rows, length), generator=generator), offset=1)


@pytest.mark.parametrize("name", MLA)
def test_layers_know_both_head_sizes(name: str) -> None:
    head_dim, value_dim, _ = SIZES[name]
    layers = attention_layers(tiny_family(name))
    assert [(layer.head_dim, layer.value_dim) for layer in layers] == [(head_dim, value_dim)] * 2


@pytest.mark.parametrize("name", MLA)
@pytest.mark.parametrize("method", ["zero", "mean"])
def test_the_exact_sweep_equals_the_naive_loop(name: str, method: str) -> None:
    loaded = _loaded(name)
    probe_set = _random_set(3)
    naive = sweep(loaded, probe_set, method=method, mode="naive", batch_size=2)
    exact = sweep(loaded, probe_set, method=method, mode="exact", batch_size=2, stack=3)
    assert exact.path.startswith("exact") and len(exact.results) == 8
    for a, b in zip(exact.results, naive.results):
        assert a.heads == b.heads and a.loss == pytest.approx(b.loss, abs=1e-5)
    assert max(abs(entry.delta) for entry in exact.results) > 1e-4


@pytest.mark.parametrize("name", MLA)
def test_patching_a_head_equals_a_hand_written_patch(name: str) -> None:
    """z: a head's slice of the output projection's input, value_dim wide."""
    loaded = _loaded(name)
    clean, corrupt = _random_set(1), _random_set(2)
    method = PatchAblation(head_outputs(loaded, clean, batch_size=2))
    result = sweep(loaded, corrupt, [(0, 1), (1, 3)], method=method, batch_size=2)
    for entry in result.results:
        expected = swapped_loss(loaded.model, corrupt.input_ids, entry.heads[0], SIZES[name][1],
                                torch.arange(4), source=clean.input_ids)
        assert entry.loss == pytest.approx(expected, abs=1e-5)
    assert any(abs(entry.delta) > 1e-4 for entry in result.results)


@pytest.mark.parametrize("name", MLA)
def test_patching_a_value_head_equals_patching_the_latent_projection(name: str) -> None:
    """A value head is its columns of kv_b_proj's output (no-rotary key, then value, per head)."""
    loaded = _loaded(name)
    clean, corrupt = _random_set(1), _random_set(2)
    _, value_dim, nope = SIZES[name]
    method = patch_method(loaded, clean, "value", batch_size=2)
    exact = sweep(loaded, corrupt, [(0, 2), (1, 1)], method=method, batch_size=2)
    for entry in exact.results:
        layer, head = entry.heads[0]
        first = head * (nope + value_dim) + nope
        expected = projection_patched_loss(loaded.model, clean.input_ids, corrupt.input_ids, layer, "kv_b_proj",
                                           slice(first, first + value_dim))
        assert entry.loss == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("name", MLA)
def test_direct_logit_attribution_sums_to_the_logit_difference(name: str) -> None:
    loaded = _loaded(name)
    contrast = random_contrast([9, 6, 11, 4])
    result = logit_attribution(loaded, contrast, batch_size=2)
    assert result.residual < 1e-4
    assert result.shares.heads.abs().max() > 1e-3
    positions = result.shares.head_positions
    assert torch.allclose(positions.sum(dim=-1), result.shares.heads, atol=1e-6)


def _proportional(found: torch.Tensor, expected: torch.Tensor) -> None:
    """found = c * expected for one scalar c (the norms' divisions, which the weights leave out)."""
    ratio = found.norm() / expected.norm()
    assert torch.allclose(found, ratio * expected, atol=1e-6 * float(found.abs().max()) + 1e-9)


def _lite() -> torch.nn.Module:
    """DeepSeek-V2-Lite's layout: queries by one full-rank q_proj (q_lora_rank None), keys and values latent."""
    import transformers as tf
    from families import MLA

    torch.manual_seed(0)
    config = tf.DeepseekV2Config(**{**MLA, "q_lora_rank": None, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                                    "v_head_dim": 16})
    return tf.DeepseekV2ForCausalLM(config).eval()


@pytest.mark.parametrize("name", [*MLA, "deepseek_v2_lite"])
def test_circuit_weights_reproduce_the_heads(name: str) -> None:
    """At position 0 (no rotation) the layer's queries, keys and values are the residual stream times W_Q, W_K,
    W_V up to each norm's division by a scalar; W_O maps the heads' outputs to the output projection's."""
    model = _lite() if name == "deepseek_v2_lite" else tiny_family(name)
    assert (model.model.layers[1].self_attn.q_proj is not None) == (name == "deepseek_v2_lite")
    head_dim, value_dim, nope = SIZES["deepseek_v2" if name == "deepseek_v2_lite" else name]
    block = model.model.layers[1]
    seen: dict[str, torch.Tensor] = {}
    handles = [block.register_forward_pre_hook(lambda _m, args, kwargs: seen.__setitem__("x", kwargs.get(
        "hidden_states", args[0] if args else None)), with_kwargs=True),
        block.self_attn.o_proj.register_forward_hook(lambda _m, args, out: seen.update(z=args[0], out=out))]

    def keep(inputs, ctx):
        if ctx.layer == 1:
            seen.update(q=inputs.query, k=inputs.key, v=inputs.value)
        return inputs

    try:
        with torch.no_grad(), attention_hooks(model, {"inputs": keep}):
            run_model(model, torch.randint(1, 120, (1, 5)))
    finally:
        for handle in handles:
            handle.remove()
    weights = layer_weights(model, attention_layers(model)[1])
    assert weights.W_Q.shape == (4, 64, head_dim) and weights.W_V.shape == (4, 64, value_dim)
    assert weights.W_O.shape == (4, value_dim, 64) and weights.folded == "input_layernorm"
    x = seen["x"][0, 0].double()
    q, k, v = (seen[key][0, :, 0].double() for key in "qkv")  # (heads, size) at position 0
    _proportional(q[:, :nope], torch.einsum("d,hde->he", x, weights.W_Q)[:, :nope])
    _proportional(k[:, :nope], torch.einsum("d,hde->he", x, weights.W_K)[:, :nope])
    _proportional(v, torch.einsum("d,hde->he", x, weights.W_V))
    rotary = torch.einsum("d,hde->he", x, weights.W_K)[:, nope:]  # V3 interleaves the rotary coordinates
    _proportional(k[:, nope:].sort(dim=-1).values, rotary.sort(dim=-1).values)
    z = seen["z"][0].double().reshape(5, 4, value_dim)
    assert torch.allclose(torch.einsum("nhe,hed->nd", z, weights.W_O), seen["out"][0].double(), atol=1e-6)


@pytest.mark.parametrize("name", MLA)
def test_classify_on_the_blocked_path_reads_the_eager_weights(name: str) -> None:
    loaded = _loaded(name)
    probe_set = _random_set(4, rows=3, length=12)
    scores = score_heads(loaded, probe_set, ["previous_token", "sink"], path="blocked", batch_size=2)
    assert scores.path == "blocked"
    with torch.no_grad():
        loaded.model.config._attn_implementation_internal = "eager"
        attentions = loaded.model(probe_set.input_ids, output_attentions=True).attentions
        loaded.model.config._attn_implementation_internal = "sdpa"
    for layer, weights in enumerate(attentions):  # (rows, heads, n, n): the mean over rows and queries
        expected = weights.diagonal(offset=-1, dim1=-2, dim2=-1).mean(dim=(0, 2)).double()
        assert torch.allclose(scores["previous_token"][layer], expected, atol=1e-5)
        assert torch.allclose(scores["sink"][layer], weights[..., 0].mean(dim=(0, 2)).double(), atol=1e-5)


@pytest.mark.parametrize("name", MLA)
def test_classify_on_the_fused_path_equals_the_blocked_path(name: str) -> None:
    loaded = _loaded(name)
    probe_set = _random_set(4, rows=3, length=12)
    names = ["previous_token", "sink", "positional"]
    fused = score_heads(loaded, probe_set, names, path="auto", batch_size=2)
    blocked = score_heads(loaded, probe_set, names, path="blocked", batch_size=2)
    assert "blocked" not in fused.path  # every layer took the fused kernel
    for key in names:
        assert torch.allclose(fused[key], blocked[key], atol=1e-5)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny DeepSeek V3 saved with save_pretrained (no tokenizer: random tokens)."""
    folder = tmp_path_factory.mktemp("deepseek") / "model"
    tiny_family("deepseek_v3").save_pretrained(folder)
    return folder


def test_the_classify_command_on_a_saved_deepseek(saved: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    out = tmp_path / "heads.json"
    code, _, stderr = run_cli(["classify", "--model", str(saved), "--num-seqs", "2", "--seq-len", "24",
                               "--json", str(out)], capsys, monkeypatch)
    assert code == 0, stderr
    assert out.is_file() and '"previous_token"' in out.read_text()


def test_the_ablate_command_on_a_saved_deepseek(saved: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    import json

    from probe.inputs import repeated_set
    from probe.models import load_model

    out = tmp_path / "ablate.json"
    code, stdout, stderr = run_cli(["ablate", "--model", str(saved), "--data", "repeated", "--num-seqs", "2",
                                    "--repeat-len", "8", "--json", str(out)], capsys, monkeypatch)
    assert code == 0, stderr
    assert "baseline loss" in stdout
    heads = {(entry["layer"], entry["head"]): entry["loss"] for entry in json.loads(out.read_text())["heads"]}
    loaded = load_model(str(saved))
    naive = sweep(loaded, repeated_set(loaded, repeat_len=8, num_seqs=2), mode="naive")
    assert len(heads) == len(naive.results) == 8
    for entry in naive.results:
        assert heads[entry.heads[0]] == pytest.approx(entry.loss, abs=1e-5)


def _failing(model: torch.nn.Module, layer: int) -> torch.utils.hooks.RemovableHandle:
    def fail(_module, _args):
        raise RuntimeError("shape '[2, 4, 12, 24]' is invalid for input of size 1536")

    return model.model.layers[layer].register_forward_pre_hook(fail)


def test_a_failing_forward_names_value_heads_of_their_own_size_not_the_length() -> None:
    loaded = _loaded("deepseek_v2")
    attention_layers(loaded.model)
    handle = _failing(loaded.model, 1)
    try:
        with pytest.raises(ProbeError, match="value heads of 16 against query/key heads of 24") as raised:
            score_heads(loaded, _random_set(1), ["sink"], path="blocked")
    finally:
        handle.remove()
    assert "seq_len" not in str(raised.value) and raised.value.parameter == "path"


def test_a_failing_forward_within_the_context_does_not_blame_the_length() -> None:
    loaded = LoadedModel(model=tiny_family("llama"), tokenizer=None, name="llama", vocab_size=120)
    attention_layers(loaded.model)
    handle = _failing(loaded.model, 0)
    try:
        with pytest.raises(ProbeError, match="not the length: 10 tokens fit its context of 256") as raised:
            score_heads(loaded, _random_set(1), ["sink"], path="blocked")
        long = ProbeSet("natural", "random ids", torch.randint(1, 120, (1, 300)), offset=1)
        with pytest.raises(ProbeError, match="longer than its context of 256: try a smaller seq_len"):
            score_heads(loaded, long, ["sink"], path="blocked")
    finally:
        handle.remove()
    assert "smaller seq_len" not in str(raised.value)


@pytest.mark.parametrize("name", MLA)
def test_window_ablation_of_every_head_equals_the_model_under_a_window_mask(name: str) -> None:
    """Sink 1, recent 3: query i sees keys 0 and i-2..i; the model's own attention under that 4-d mask."""
    from probe.ablation import ablate
    from probe.ablation.window import WindowAblation

    model = tiny_family(name)
    ids = torch.randint(1, 120, (2, 40), generator=torch.Generator().manual_seed(2))
    query, key = torch.arange(40)[:, None], torch.arange(40)[None, :]
    allowed = (key <= query) & ((key == 0) | (key >= query - 2))
    window = torch.zeros(2, 1, 40, 40).masked_fill(~allowed, torch.finfo(torch.float32).min)
    every = [(layer, head) for layer in range(2) for head in range(4)]
    with torch.no_grad():
        expected = model(ids, attention_mask=window).logits
        with ablate(model, every, method=WindowAblation(sink=1, recent=3)):
            windowed = model(ids).logits
        plain = model(ids).logits
    assert (windowed - expected).abs().max() <= 1e-5
    assert (plain - expected).abs().max() > 1e-2

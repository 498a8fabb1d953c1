"""Issue 47: models wrapped by TransformerLens 4 (`TransformerBridge`) and nnsight (`NNsight`, `LanguageModel`) are
probed as the Hugging Face model inside them: the same classification and ablation effects as the bare model, with the
wrapper's tokenizer, and the wrapper runs afterwards with the same output as before. Tiny random models, offline (a
bridge is booted from a model in memory and a tokenizer saved to a folder; an nnsight model is also loaded lazily from
a saved folder). The packages come with the `wrappers` extra; without them those tests skip."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_hf
from words import words_tokenizer

from probe import classify, load_model
from probe.ablation import sweep
from probe.errors import ProbeError
from probe.inputs import repeated_set
from probe.models import LoadedModel
from probe.models.wrapped import wrapper_of

KINDS = ["gpt2", "llama_gqa"]
IDS = torch.tensor([[0, 5, 9, 17, 33, 5, 9, 17, 33, 60]])
HEADS = [(0, 1), (1, 3)]


def _needs(package: str) -> None:
    pytest.importorskip(package, reason=f"{package} is not installed: pip install 'probe-heads[wrappers]'")


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real word-level tokenizer (117 tokens, within the tiny models' 120) saved to a folder: TransformerLens
    reloads a tokenizer from where it was loaded (its `name_or_path`) to make it prepend BOS."""
    folder = tmp_path_factory.mktemp("tokenizer")
    tokenizer = words_tokenizer()
    tokenizer.eos_token = tokenizer.pad_token = "<s>"
    tokenizer.save_pretrained(folder)
    return folder


def _tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def _probed(loaded: LoadedModel) -> tuple[dict[str, torch.Tensor], list[float]]:
    """What the comparisons compare: every class's scores, and two heads' zero-ablation effects."""
    result = classify(loaded, seq_len=16, num_seqs=2, repeat_len=8)
    swept = sweep(loaded, repeated_set(loaded, repeat_len=8, num_seqs=2), HEADS)
    return result.scores, [row.delta for row in sorted(swept.results, key=lambda row: (row.layer, row.head))]


def _assert_same(got: tuple[dict[str, torch.Tensor], list[float]],
                 expected: tuple[dict[str, torch.Tensor], list[float]]) -> None:
    scores, deltas = got
    assert scores.keys() == expected[0].keys()
    for name, score in expected[0].items():
        torch.testing.assert_close(scores[name], score, atol=1e-5, rtol=1e-5, msg=name)
    assert deltas == pytest.approx(expected[1], abs=1e-5)


def _hooks(model: torch.nn.Module) -> int:
    """Every hook on every module: what probe installs while it runs, and must have removed after."""
    return sum(len(getattr(module, name)) for module in model.modules() for name in vars(module)
               if name.endswith("_hooks") and isinstance(getattr(module, name), dict))


@pytest.mark.parametrize("kind, dtype", [(kind, torch.float32) for kind in KINDS] + [("llama_gqa", torch.bfloat16)])
def test_a_transformerlens_bridge_is_probed_as_its_model(kind: str, dtype: torch.dtype, tokenizer_folder: Path) -> None:
    """Booting switches the model to eager attention (TransformerLens reads its weights there): the bare model
    compared is the same in eager attention, so that half precision compares kernels that round alike."""
    _needs("transformer_lens")
    from transformer_lens.model_bridge import TransformerBridge

    model = tiny_hf(kind).to(dtype)
    model.set_attn_implementation("eager")
    expected = _probed(load_model(model, tokenizer=_tokenizer(tokenizer_folder)))  # before the bridge wraps it
    bridge = TransformerBridge.boot_transformers(f"tiny-{kind}", hf_model=model, tokenizer=_tokenizer(tokenizer_folder),
                                                 device="cpu", dtype=dtype)
    logits, cache = bridge.run_with_cache(IDS)
    hooks = _hooks(bridge)

    loaded = load_model(bridge)
    assert loaded.tokenizer is bridge.tokenizer and loaded.name == f"tiny-{kind}"
    assert type(loaded.model) is type(model) and next(loaded.model.parameters()).dtype == dtype
    shared = {parameter.data_ptr() for parameter in bridge.parameters()}
    assert {parameter.data_ptr() for parameter in loaded.model.parameters()} <= shared  # nothing copied
    _assert_same(_probed(loaded), expected)

    assert _hooks(bridge) == hooks
    after, cache_after = bridge.run_with_cache(IDS)  # the bridge's own forward and hook points, as before
    assert torch.equal(after, logits)
    assert torch.equal(cache_after["blocks.1.attn.hook_pattern"], cache["blocks.1.attn.hook_pattern"])
    if dtype == torch.float32:  # the model inside the bridge, given alone, is probed through its own modules too
        _assert_same(_probed(load_model(bridge.original_model, tokenizer=_tokenizer(tokenizer_folder))), expected)
        assert torch.equal(bridge(IDS), logits)


def test_a_bridge_over_a_dispatched_model_is_probed_through_its_own_modules(tokenizer_folder: Path) -> None:
    """accelerate's device-map hooks (a model spread over GPUs) bind `forward` to the module they hook: the view's
    copy of a hooked decoder layer must call its own children, not the bridge's components (which compute attention
    outside transformers' interface: probe would read nothing)."""
    _needs("transformer_lens")
    from accelerate.hooks import ModelHook, add_hook_to_module
    from transformer_lens.model_bridge import TransformerBridge

    model = tiny_hf("llama_gqa")
    expected = _probed(load_model(model, tokenizer=_tokenizer(tokenizer_folder)))
    for layer in model.model.layers:
        add_hook_to_module(layer, ModelHook())
    bridge = TransformerBridge.boot_transformers("tiny", hf_model=model, tokenizer=_tokenizer(tokenizer_folder),
                                                 device="cpu")
    logits = bridge(IDS)
    _assert_same(_probed(load_model(bridge)), expected)
    assert torch.equal(bridge(IDS), logits)


def test_a_bridge_in_compatibility_mode_is_probed_as_it_runs(tokenizer_folder: Path) -> None:
    """`enable_compatibility_mode()` folds LayerNorm into the weights and centres them, in the model's own tensors:
    the model probe runs computes what the bridge computes."""
    _needs("transformer_lens")
    from transformer_lens.model_bridge import TransformerBridge

    bridge = TransformerBridge.boot_transformers("tiny", hf_model=tiny_hf("gpt2"),
                                                 tokenizer=_tokenizer(tokenizer_folder), device="cpu")
    bridge.enable_compatibility_mode()
    with torch.no_grad():
        torch.testing.assert_close(load_model(bridge).model(IDS).logits, bridge(IDS), atol=1e-5, rtol=0)


@pytest.mark.filterwarnings("ignore:LanguageModel is deprecated")  # nnsight 0.8 prefers TransformersModel(...)
@pytest.mark.parametrize("kind", KINDS)
def test_an_nnsight_model_is_probed_in_place(kind: str, tokenizer_folder: Path) -> None:
    _needs("nnsight")
    import nnsight

    expected = _probed(load_model(tiny_hf(kind), tokenizer=_tokenizer(tokenizer_folder)))  # the same weights (seed 0)
    wrapped = nnsight.LanguageModel(tiny_hf(kind), tokenizer=_tokenizer(tokenizer_folder))
    with wrapped.trace(IDS):
        before = wrapped.output.save()
    hooks = _hooks(wrapped._module)

    loaded = load_model(wrapped)
    assert loaded.model is wrapped._module and loaded.tokenizer is wrapped.tokenizer
    _assert_same(_probed(loaded), expected)

    assert _hooks(wrapped._module) == hooks
    with wrapped.trace(IDS):  # nnsight's own trace, and an intervention through it
        after = wrapped.output.save()
    assert torch.equal(after.logits, before.logits)
    bare = nnsight.NNsight(tiny_hf(kind))
    assert load_model(bare).tokenizer is None and load_model(bare, tokenizer="mine").tokenizer == "mine"


def test_a_lazy_nnsight_model_is_loaded_as_its_first_trace_would(tokenizer_folder: Path, tmp_path: Path) -> None:
    """`TransformersModel(folder, task=...)` (nnsight 0.8's successor of LanguageModel) builds the model on the meta
    device and loads the weights at the first trace: load_model loads them, and probes the loaded model."""
    _needs("nnsight")
    import nnsight

    model = tiny_hf("llama_gqa")
    model.save_pretrained(tmp_path)
    _tokenizer(tokenizer_folder).save_pretrained(tmp_path)
    expected = _probed(load_model(model, tokenizer=_tokenizer(tokenizer_folder)))
    wrapped = nnsight.TransformersModel(str(tmp_path), task="text-generation", tokenizer=_tokenizer(tmp_path))
    assert not wrapped.dispatched
    loaded = load_model(wrapped)
    assert wrapped.dispatched and loaded.model is wrapped._module
    _assert_same(_probed(loaded), expected)


def test_wrappers_are_probed_where_they_are(tokenizer_folder: Path) -> None:
    """dtype, device and placement belong to the wrapper: a cast here would leave its own state behind."""
    _needs("nnsight")
    import nnsight

    wrapped = nnsight.NNsight(tiny_hf("gpt2"))
    with pytest.raises(ProbeError, match=r"wrapped by nnsight .* cast or move the wrapper itself .* without dtype$"):
        load_model(wrapped, dtype="float16")
    with pytest.raises(ProbeError, match="without device, device_map$"):
        load_model(wrapped, device="cpu", device_map="auto")
    assert next(wrapped._module.parameters()).dtype == torch.float32
    with pytest.raises(ProbeError, match=r"one submodule \(model.transformer.h.0\) of a model: give load_model the"):
        load_model(wrapped.transformer.h[0])


def test_neither_library_is_imported_to_recognise_an_object(monkeypatch: pytest.MonkeyPatch) -> None:
    """Recognising a wrapper reads the class's module and name: with both packages unimportable, plain modules load
    and anything else gets the one-line refusal naming what load_model takes."""
    for package in ("transformer_lens", "nnsight"):
        monkeypatch.setitem(sys.modules, package, None)  # any import of it now fails
    model = tiny_hf("gpt2")
    assert wrapper_of(model) is None and wrapper_of("smollm2") is None
    assert load_model(model).model is model
    with pytest.raises(ProbeError, match=r"^spec must be a model name or path, an nn.Module, or a model wrapped by "
                                         r"TransformerLens \(TransformerBridge\) or nnsight \(NNsight, LanguageModel, "
                                         r"TransformersModel\), got object$"):
        load_model(object())  # type: ignore[arg-type]

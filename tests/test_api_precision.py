"""Half precision, function by function (issue 45; the contract is docs/precision.md): every public function the docs
import, called once as the docs call it on a tiny model in bfloat16 and in float16, against the same call in
float32 (run once, shared by both): every number it returns finite where float32's is (NaN only where float32's is),
within a bound measured on these models, and the result's dtype the run's. tests/test_precision.py does the same for
the commands."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from conftest import tiny_hf
from probe import LoadedModel, attention_hooks, capture_attention, classify, kv_heads, load_model
from probe.ablation import ablate, estimate, head_means, load_results, sweep
from probe.ablation.prune import prune
from probe.ablation.window import WindowAblation
from probe.atlas import atlas
from probe.circuits import composition_scores, copying_scores
from probe.dla import logit_attribution, next_token_attribution
from probe.headmaps import compare, read_map
from probe.ablation.methods import add_to_head, scale_head
from probe.hooks.trace import Trace
from probe.inputs import (ProbeSet, contrast_logit_diffs, contrast_task, logit_diff, natural_set, normalised_effect,
                          repeated_set)
from probe.inputs.contrast import logit_diffs
from probe.patching import contrast_runs, patch_contrast, patch_heads
from probe.patching.paths import path_contrast
from probe.patterns import attention_patterns
from probe.selfrepair import contrast_self_repair, text_self_repair
from probe.steering import find_heads, generations, steer, steer_curves
from probe.syntax.run import syntax_scores
from probe.track import TrackOptions, find_run, track
from test_precision import _float16_supported

TESTS = Path(__file__).parent
DTYPES = ("bfloat16", "float16")
IGNORED = {"seconds", "provenance", "timestamp_utc", "dtype", "examples", "costs", "forward_equivalents",
           "max_residual", "rounding_bound", "sum", "command"}
"""Keys of a payload that are not compared: times, what differs by design (the dtype, the rounding), and examples,
which a run picks by weight."""


def _numbers(value: Any, path: tuple = ()) -> Iterator[tuple[tuple, float]]:
    """Every float of a result by its path (NaN and inf included, to be compared): payloads, tensors (as float64),
    lists of heads keyed by (layer, head) so that two runs' orders need not agree."""
    if isinstance(value, torch.Tensor):
        yield from _numbers(value.detach().double().cpu().tolist(), path)
    elif isinstance(value, np.ndarray):
        yield from _numbers(value.astype(np.float64).tolist(), path)
    elif isinstance(value, dict):
        for key, item in value.items():
            if key not in IGNORED:
                yield from _numbers(item, (*path, key))
    elif isinstance(value, (list, tuple)):
        keyed = bool(value) and all(isinstance(item, dict) and "layer" in item and "head" in item for item in value)
        for index, item in enumerate(value):
            yield from _numbers(item, (*path, (item["layer"], item["head"]) if keyed else index))
    elif isinstance(value, float) or (isinstance(value, int) and not isinstance(value, bool)):
        yield path, float(value)


def largest_difference(half: Any, full: Any, ignored: frozenset[str] = frozenset()) -> tuple[float, tuple]:
    """The largest |half - float32| over every number (but those under an `ignored` key), after checking that half is
    finite exactly where float32 is."""
    def kept(value: Any) -> dict[tuple, float]:
        return {path: number for path, number in _numbers(value) if not ignored & {str(key) for key in path}}

    ours, theirs = kept(half), kept(full)
    assert ours.keys() == theirs.keys(), sorted(ours.keys() ^ theirs.keys(), key=str)[:5]
    mismatched = [p for p in ours if math.isfinite(ours[p]) != math.isfinite(theirs[p])
                  or math.isnan(ours[p]) != math.isnan(theirs[p])]
    assert not mismatched, [(p, ours[p], theirs[p]) for p in mismatched[:5]]
    return max(((abs(ours[p] - theirs[p]), p) for p in ours if math.isfinite(theirs[p])), default=(0.0, ()))


_LOADED: dict[str, LoadedModel] = {}


def words(dtype: str) -> LoadedModel:
    """The words llama in `dtype`, loaded once per dtype (every call restores it)."""
    if dtype not in _LOADED:
        from words import tiny_with_words

        model, tokenizer = tiny_with_words()
        _LOADED[dtype] = load_model(model, tokenizer=tokenizer, name="words", dtype=dtype)
    return _LOADED[dtype]


IDS = torch.randint(2, 60, (2, 12), generator=torch.Generator().manual_seed(0))


def _repeated(loaded: LoadedModel) -> ProbeSet:
    return repeated_set(loaded, repeat_len=6, num_seqs=2)


def _ioi(loaded: LoadedModel) -> Any:
    return contrast_task(loaded, "ioi", count=4, seed=0)


def _weights(loaded: LoadedModel) -> dict[str, Any]:
    seen: list[torch.Tensor] = []
    with torch.no_grad(), attention_hooks(loaded.model, {"pattern": lambda w, ctx: seen.append(w.clone())}):
        loaded.model(IDS)
    return {"weights": seen, "captured": capture_attention(loaded.model, IDS)}


def _trace(loaded: LoadedModel) -> dict[str, Any]:
    vector = torch.linspace(-1, 1, 16)
    writers = {"z": {1: scale_head(3, 2.0)}, "v": {0: add_to_head(1, vector)}}
    with torch.no_grad(), Trace(loaded.model, writers, read=["z", "pattern"], layers=[1]) as trace:
        logits = loaded.model(IDS).logits
    with torch.no_grad(), ablate(loaded.model, [(1, 2), (0, 1)]):
        ablated = loaded.model(IDS).logits
    return {"z": trace[1]["z"], "pattern": trace[1]["pattern"], "logits": logits, "ablated": ablated}


def _ablation(loaded: LoadedModel, tmp: Path) -> dict[str, Any]:
    data = _repeated(loaded)
    swept = sweep(loaded, data, results_path=tmp / "s.jsonl")
    means = head_means(loaded, data)
    return {"sweep": swept, "loaded": load_results(tmp / "s.jsonl"),
            "means": means.values, "mean": sweep(loaded, data, [(1, 2)], method="mean"),
            "noise": sweep(loaded, data, [(1, 2)], method="noise", metric="kl", seed=3),
            "window": sweep(loaded, data, [(1, 2), (0, 3)], method=WindowAblation(sink=1, recent=3))}


def _inputs(loaded: LoadedModel) -> dict[str, Any]:
    ioi = _ioi(loaded)
    clean, corrupt = contrast_logit_diffs(loaded, ioi)
    with torch.no_grad():
        logits = loaded.model(ioi.clean[:2]).logits
    return {"natural": natural_set(loaded, seq_len=12, num_seqs=2).input_ids,
            "repeated": _repeated(loaded).input_ids,
            "logit_diffs": logit_diffs(loaded, ioi, ioi.clean), "clean": clean, "corrupt": corrupt,
            "logit_diff": logit_diff(logits, ioi, slice(0, 2)),
            "normalised": normalised_effect(clean[0], clean.mean(), corrupt.mean())}


def _steering(loaded: LoadedModel) -> dict[str, Any]:
    probe_set = contrast_runs(loaded, _ioi(loaded))[0]
    with torch.no_grad(), steer(loaded, {"1.2": 3.0, "0.1": 0.0}):
        logits = loaded.model(IDS).logits
    texts = generations(loaded, "the keys to the", [(1, 2)], [0.0, 3.0], max_new_tokens=3, seed=0)
    return {"steered": logits, "curves": steer_curves(loaded, probe_set, [(1, 2)], [0.0, 2.0]),
            "found": find_heads(loaded, probe_set, 3.0), "generated": len(texts)}


def _patching(loaded: LoadedModel) -> dict[str, Any]:
    ioi = _ioi(loaded)
    clean, corrupt = contrast_runs(loaded, ioi)
    return {"contrast": patch_contrast(loaded, ioi),
            "value": patch_heads(loaded, clean, corrupt, component="value", noising=True, by_position=True),
            "path": path_contrast(loaded, ioi, senders=[(0, 1)], receivers=[(1, 2)], component="query"),
            "direct": path_contrast(loaded, ioi, senders=[(1, 2), (0, 1)], receivers="logits")}


def _dla(loaded: LoadedModel) -> dict[str, Any]:
    return {"contrast": logit_attribution(loaded, _ioi(loaded)),
            "next": next_token_attribution(loaded, IDS, torch.ones_like(IDS))}


def _self_repair(loaded: LoadedModel) -> dict[str, Any]:
    text = natural_set(loaded, seq_len=12, num_seqs=2)
    return {"contrast": contrast_self_repair(loaded, _ioi(loaded)), "text": text_self_repair(loaded, text)}


def _syntax(dtype: str, tmp: Path) -> Any:
    from planted_syntax import conllu_corpus, planted_pair

    from probe.syntax.conllu import read_conllu

    (tmp / "corpus.conllu").write_text(conllu_corpus(16), encoding="utf-8")
    model, tokenizer = planted_pair()
    loaded = load_model(model, tokenizer=tokenizer, name="planted", dtype=dtype)
    return syntax_scores(loaded, read_conllu(tmp / "corpus.conllu"), scheme="ud", source="planted", min_count=5)


def _track(dtype: str, tmp: Path) -> Any:
    from test_track import tiny_checkpoints

    tiny_checkpoints(tmp / "ckpt", (0, 5))
    run = find_run(f"{TESTS / 'track_models.py'}:tiny", checkpoints=str(tmp / "ckpt" / "step-*.pt"))
    options = TrackOptions(seq_len=24, num_seqs=2, repeat_len=8, icl_seqs=2)
    return track(run, options, results_path=tmp / "track.jsonl", dtype=dtype)


def _maps(loaded: LoadedModel, tmp: Path) -> Any:
    """A head map of scores computed in the run's dtype, written as `probe classify --json` writes it and read back."""
    path = tmp / "classify.json"
    path.write_text(json.dumps(classify(loaded, seq_len=24, num_seqs=2, repeat_len=8).to_dict()), encoding="utf-8")
    return read_map(path, "induction")


def _circuits(dtype: str) -> dict[str, Any]:
    model = tiny_hf("llama_gqa").to(getattr(torch, dtype))
    return {"composition": composition_scores(model), "copying": copying_scores(model)}


CALLS: dict[str, Callable[[str, Path], Any]] = {
    "classify": lambda d, tmp: classify(words(d), seq_len=24, num_seqs=2, repeat_len=8),
    "attention": lambda d, tmp: _weights(words(d)),
    "trace": lambda d, tmp: _trace(words(d)),
    "kv_heads": lambda d, tmp: kv_heads(words(d), lengths=(120,), depths=(0.5,), sink=1, recent=4, curve=False,
                                        full_fraction=0.5, needle="the keys to the cabinet are {key}"),
    "ablation": lambda d, tmp: _ablation(words(d), tmp),
    "estimate": lambda d, tmp: estimate(words(d), _repeated(words(d))),
    "prune": lambda d, tmp: prune(words(d), _repeated(words(d)), step=0.25, seeds=(0,)),
    "patching": lambda d, tmp: _patching(words(d)),
    "attribution_patching": lambda d, tmp: {component: patch_contrast(words(d), _ioi(words(d)), estimate=True,
                                                                      component=component)
                                            for component in ("output", "query", "key", "value")},
    "dla": lambda d, tmp: _dla(words(d)),
    "self_repair": lambda d, tmp: _self_repair(words(d)),
    "steering": lambda d, tmp: _steering(words(d)),
    "circuits": lambda d, tmp: _circuits(d),
    "atlas": lambda d, tmp: atlas(words(d), seq_len=24, num_seqs=2, repeat_len=8, fast=True, task_count=4),
    "track": _track,
    "syntax": _syntax,
    "patterns": lambda d, tmp: attention_patterns(words(d), IDS[0], source="ids"),
    "inputs": lambda d, tmp: _inputs(words(d)),
    "headmaps": lambda d, tmp: _maps(words(d), tmp),
}
"""Each documented function called as the docs call it, in the dtype given, writing into `tmp`."""


def payload(result: Any, dtypes: list[str]) -> Any:
    """What is compared of a result: its `to_dict()` where it has one (its `dtype`, attribute and key, collected into
    `dtypes`), a dict's or list's items, a tensor (its dtype collected) or number as it is."""
    if hasattr(result, "to_dict"):
        written = result.to_dict()
        dtypes.extend(str(d) for d in (getattr(result, "dtype", None), written.get("dtype")) if d is not None)
        return written
    if isinstance(result, dict):
        return {key: payload(item, dtypes) for key, item in result.items()}
    if isinstance(result, (list, tuple)):
        return [payload(item, dtypes) for item in result]
    if isinstance(result, torch.Tensor) and result.is_floating_point():
        dtypes.append(str(result.dtype).removeprefix("torch."))
    return result


# The largest |half - float32| of any number a call returns, measured on these models, bfloat16 / float16:
# classify 3e-5 / 6e-6, attention weights 1.4e-4 / 1.6e-5, trace (z, logits) 3.8e-3 / 5.1e-4, kv_heads 9e-6 / 3e-6,
# ablation (sweep, load_results, head_means; mean, noise and window ablation) 2.3e-3 / 2.7e-4, estimate 4.2e-4 /
# 8.9e-5, prune 4.3e-4 / 1.0e-4, patching (logit differences) 1.0e-3 / 1.5e-4, attribution patching (output, query,
# key and value) 1.2e-2 / 7.7e-4, dla 4.5e-4 / 7.3e-5, self-repair 1.2e-3 / 1.3e-4, steering 4.2e-3 / 5.1e-4,
# circuits 6.1e-4 / 9.8e-5, atlas 1.5e-3 / 1.9e-4, track 2.6e-3 / 2.6e-4, syntax 0 / 0 (its argmax counts apart),
# patterns 1e-3 / 1e-3 (the heatmap payload's weights, rounded to 0.001), inputs 2.4e-3 / 3.6e-4, headmaps
# (compare's difference) 7e-6 / 2e-6. Bounds: 3 to 10 times those, float16's tighter.
BOUNDS = {
    "bfloat16": {"classify": 1e-3, "attention": 2e-3, "trace": 0.02, "kv_heads": 1e-3, "ablation": 0.01,
                 "estimate": 5e-3, "prune": 5e-3, "patching": 0.01, "attribution_patching": 0.04, "dla": 5e-3,
                 "self_repair": 0.01, "steering": 0.02, "circuits": 5e-3, "atlas": 0.01, "track": 0.02,
                 "syntax": 5e-3, "patterns": 5e-3, "inputs": 0.02, "headmaps": 1e-3},
    "float16": {"classify": 2e-4, "attention": 2e-4, "trace": 3e-3, "kv_heads": 2e-4, "ablation": 1.5e-3,
                "estimate": 1e-3, "prune": 1e-3, "patching": 2e-3, "attribution_patching": 4e-3, "dla": 1e-3,
                "self_repair": 2e-3, "steering": 3e-3, "circuits": 1e-3, "atlas": 2e-3, "track": 3e-3,
                "syntax": 1e-3, "patterns": 3e-3, "inputs": 3e-3, "headmaps": 2e-4},
}
IGNORE = {"ablation": frozenset({"top_tokens", "specificity"}), "self_repair": frozenset({"repaired"}),
          "patching": frozenset({"patch_effect"}), "inputs": frozenset({"normalised"}),
          "track": frozenset({"positional"}),
          "syntax": frozenset({"accuracy", "margin", "best", "baseline"})}
"""Numbers held to something else than a difference: which tokens an ablation moves most (ties reorder); ratios of
compared numbers (an ablation's specificity, its top tokens' share of deltas that cancel: 0.028 apart in bfloat16
here, tests/test_precision.py holds the command's; self-repair's `repaired`; patch effects and normalised_effect,
which divide by clean - corrupt, 0.04 here: their logit differences are compared); what counts rows by their top
key (track's positional score, syntax's accuracies: on these random models' near-uniform rows a rounding flips
near-ties; syntax is held to the same heads instead)."""
WIDER = {"float32", "float64"}
"""What probe computes around the model is float32 or wider (attention weights, statistics, logit differences,
shares); what the model computes (z, logits) is in its dtype."""
ALL_WIDER = {"attention", "circuits", "inputs"}
"""Calls whose every result is wider than the model (attention weights: float32; composition and copying scores,
logit differences: float64); every other call returns a result in the run's dtype or saying it."""


def _paths(value: Any, path: tuple = ()) -> Iterator[tuple[tuple, str]]:
    """The paths a result says it took (`mode`, `path`: exact, or naive and why), by where they stand."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key in ("mode", "path") and isinstance(item, str):
                yield (*path, key), item
            yield from _paths(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, (*path, index))


@pytest.fixture(scope="module")
def float32_results() -> dict[str, Any]:
    """Each call's float32 result, by name, made by the first test that needs it: bfloat16's and float16's tests
    compare with the same one."""
    return {}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CALLS))
def test_every_public_function_in_half_precision_lies_near_float32(
        name: str, dtype: str, float32_results: dict[str, Any], tmp_path: Path, monkeypatch) -> None:
    """Issue 45, the Python API: each documented function in bfloat16 and in float16 (where this CPU has float16's
    operations) against its float32 call: finite where float32 is, within the bound measured, in the run's dtype."""
    why = _float16_supported() if dtype == "float16" else ""
    if why:
        pytest.skip(why)
    import probe.inputs.contrast as contrast

    monkeypatch.setattr(contrast, "MIN_GAP", 1e-4)  # a random tiny model's corruption changes little
    if name not in float32_results:
        (tmp_path / "float32").mkdir()
        float32_results[name] = CALLS[name]("float32", tmp_path / "float32")
    (tmp_path / dtype).mkdir()
    half, full = CALLS[name](dtype, tmp_path / dtype), float32_results[name]
    if name == "headmaps":  # the maps compared by probe's own compare: float32's map against the half run's
        assert half.dtype == dtype and full.dtype == "float32"
        assert float(np.abs(compare(full, half).difference).max()) <= BOUNDS[dtype][name]
        return
    dtypes: list[str] = []
    ours, theirs = payload(half, dtypes), payload(full, [])
    difference, where = largest_difference(ours, theirs, IGNORE.get(name, frozenset()))
    assert difference <= BOUNDS[dtype][name], (difference, where)
    assert dict(_paths(ours)) == dict(_paths(theirs))  # no exact path fell back to the naive one in half precision
    assert dtypes and set(dtypes) <= {dtype} | WIDER, dtypes  # each result says the run's dtype, or is wider
    assert (dtype in dtypes) != (name in ALL_WIDER), dtypes
    if name == "syntax":
        assert [(e["layer"], e["head"]) for e in ours["syntactic"]] == [(e["layer"], e["head"])
                                                                         for e in theirs["syntactic"]]


def test_estimate_in_float16_keeps_the_gradients_of_a_mean_over_many_tokens() -> None:
    """The gradient of a mean over 2,016 tokens falls under float16's smallest normal, where it keeps fewer bits (the
    estimate lay 1.4e-5 from float32's, further than bfloat16's 8e-6); scaled by a power of two before the backward
    (probe.ablation.estimate.gradient_scale) float16 carries its 8 times bfloat16's precision again: measured 9e-7."""
    why = _float16_supported()
    if why:
        pytest.skip(why)
    ids = torch.randint(2, 120, (32, 64), generator=torch.Generator().manual_seed(0))
    deltas = {}
    for dtype in ("float32", "bfloat16", "float16"):
        loaded = load_model(tiny_hf("llama_gqa"), name="tiny", dtype=dtype)
        result = estimate(loaded, ProbeSet("natural", "random ids", ids, 0), samples=0, refine=0)
        deltas[dtype] = torch.tensor([head.delta for head in result.heads], dtype=torch.float64)
    bfloat16, float16 = ((deltas[dtype] - deltas["float32"]).abs().max() for dtype in ("bfloat16", "float16"))
    assert float16 <= bfloat16 / 4, (float(float16), float(bfloat16))


def test_a_scaled_gradient_past_float16s_range_falls_back_to_the_unscaled_one() -> None:
    """scaled_gradients multiplies a mean over 1,024 tokens by 1,024 before the backward; where that would pass
    65504 in float16 (an inf, then NaN terms), the unscaled gradient is returned instead, with scale 1."""
    from probe.ablation.estimate import scaled_gradients

    leaf = torch.ones(4, dtype=torch.float16, requires_grad=True)
    for factor, scale, gradient in ((1.0, 1024.0, 128.0), (1000.0, 1.0, 125.0)):
        (grad,), chosen = scaled_gradients((leaf.float() * factor).sum() / 8, 1024, [leaf])
        assert chosen == scale and grad is not None and torch.equal(grad, torch.full_like(leaf, gradient))

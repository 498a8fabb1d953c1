"""Ablation: hook-based ablation equals zeroing the output projection's weights, the exact sweep equals the naive
loop, the planted induction circuit breaks when its heads are removed, sweeps resume, the model is left untouched
(also after an error or Ctrl-C), and bad input ends in one clear line."""

from __future__ import annotations

import hashlib
import importlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import run_cli, tiny_hf, tiny_loaded
from planted import UNRELATED, PlantedModel, TextbookAttention, planted_mha, planted_textbook

from probe.hooks.types import HookContext
from probe.ablation import (AblationMethod, HeadResult, METHODS, ablate, all_heads, estimate,
                            head_means, load_results, parse_heads, read_results, sweep)
from probe.ablation.estimate import BACKWARD_COST, GRAD_FORWARD_COST, gumbel_draws
from probe.ablation.blocks import WORK_UNITS
from probe.hooks.layers import attention_layers
from probe.hooks.run import logits_of, run_model
from probe.inputs import ProbeSet, natural_set, repeated_set
from probe.errors import ProbeError
from probe.models import LoadedModel
from probe.reports.files import write_csv

TESTS = Path(__file__).parent
HF_KINDS = ["llama_gqa", "llama_mqa", "qwen2", "gemma2", "gpt2", "gpt_bigcode", "bert"]


def planted_loaded(factory=planted_textbook) -> LoadedModel:
    return LoadedModel(model=factory(), tokenizer=None, name=factory.__name__, vocab_size=200)


def small_set(loaded: LoadedModel, seqs: int = 3, repeat: int = 9) -> ProbeSet:
    return repeated_set(loaded, repeat_len=repeat, num_seqs=seqs)


# ---------------------------------------------------------------------------------------------------------------
# an independent implementation: zero the head's columns of the output projection's weight


def projection(model: torch.nn.Module, layer: int) -> tuple[torch.nn.Module, str]:
    """The output projection of attention layer `layer` and how its weight is laid out."""
    if isinstance(model, PlantedModel):
        block = model.layers[layer]
        return (block.W_o, "linear") if isinstance(block, TextbookAttention) else (block.attn.out_proj, "linear")
    name = type(model).__name__
    if name.startswith("GPT2"):
        return model.transformer.h[layer].attn.c_proj, "conv1d"  # Conv1D: weight (in, out)
    if name.startswith("GPTBigCode"):
        return model.transformer.h[layer].attn.c_proj, "linear"
    if name.startswith("Bert"):
        return model.encoder.layer[layer].attention.output.dense, "linear"
    return model.model.layers[layer].self_attn.o_proj, "linear"


@contextmanager
def weights_zeroed(model: torch.nn.Module, heads: list[tuple[int, int]], head_dim: int,
                   means: dict[tuple[int, int], torch.Tensor] | None = None) -> Iterator[None]:
    """For the body of the `with`, each head's input columns of the output projection are zeroed (in place, put
    back after); for mean ablation the head's mean contribution W_o[:, h] @ mean is added to the projection's bias."""
    saved = []
    try:
        for layer, head in heads:
            module, layout = projection(model, layer)
            columns = slice(head * head_dim, (head + 1) * head_dim)
            with torch.no_grad():
                block = module.weight[columns, :] if layout == "conv1d" else module.weight[:, columns]
                saved.append((module, layout, columns, block.clone(), module.bias))
                if means is not None:
                    constant = (means[(layer, head)] @ block) if layout == "conv1d" else (block @ means[(layer, head)])
                    bias = module.bias if module.bias is not None else torch.zeros_like(constant)
                    module.bias = torch.nn.Parameter(bias.detach() + constant)
                block.zero_()
        yield
    finally:
        with torch.no_grad():
            for module, layout, columns, block, bias in reversed(saved):
                (module.weight[columns, :] if layout == "conv1d" else module.weight[:, columns]).copy_(block)
                module.bias = bias


def reference_means(model: torch.nn.Module, ids: torch.Tensor, heads: list[tuple[int, int]], head_dim: int
                    ) -> dict[tuple[int, int], torch.Tensor]:
    """Each head's mean input slice to the output projection over all positions, read with a plain pre-hook."""
    seen: dict[int, torch.Tensor] = {}
    handles = []
    for layer in {layer for layer, _ in heads}:
        module, _ = projection(model, layer)
        handles.append(module.register_forward_pre_hook(
            lambda _m, args, layer=layer: seen.__setitem__(layer, args[0].detach().reshape(-1, args[0].shape[-1]))))
    with torch.no_grad():
        run_model(model, ids)
    for handle in handles:
        handle.remove()
    return {(layer, head): seen[layer][:, head * head_dim:(head + 1) * head_dim].mean(dim=0) for layer, head in heads}


def reference_metric(model: torch.nn.Module, ids: torch.Tensor, baseline: torch.Tensor | None, causal: bool) -> float:
    with torch.no_grad():
        out = logits_of(run_model(model, ids)).float()
    if causal:
        return float(F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), ids[:, 1:].reshape(-1)))
    return float((1 - F.cosine_similarity(out, baseline, dim=-1)).mean())


@pytest.mark.slow
@pytest.mark.parametrize("kind", HF_KINDS + ["planted_textbook", "planted_fused", "planted_mha"])
@pytest.mark.parametrize("method", ["zero", "mean"])
def test_hook_ablation_equals_zeroed_projection_weights(kind: str, method: str) -> None:
    if kind.startswith("planted"):
        factory = {"planted_textbook": planted_textbook, "planted_mha": planted_mha,
                   "planted_fused": lambda: planted_textbook(fused=True)}[kind]
        loaded = LoadedModel(model=factory(), tokenizer=None, name=kind, vocab_size=200)
    else:
        loaded = tiny_loaded(kind)
    model = loaded.model
    layers = attention_layers(model)
    head_dim = layers[0].head_dim
    probe_set = small_set(loaded)
    ids = probe_set.input_ids
    causal = kind != "bert"
    singles = [(0, 1), (1, 2), (1, 3)]
    together = [(0, 0), (1, 1)]
    means = head_means(loaded, probe_set) if method == "mean" else None
    result = sweep(loaded, probe_set, singles, groups=[together], method=method, statistics=means, batch_size=2)
    assert result.metric == ("cross_entropy" if causal else "cosine_distance")
    with torch.no_grad():
        baseline_out = logits_of(run_model(model, ids)).float()
    expected_baseline = reference_metric(model, ids, baseline_out, causal)
    assert result.baseline_loss == pytest.approx(expected_baseline, abs=1e-5)
    for entry in result.results:
        heads = list(entry.heads)
        # nn.MultiheadAttention does not call its out_proj module: read the means from the textbook twin
        twin = planted_textbook() if kind == "planted_mha" else model
        reference_means_ = reference_means(twin, ids, heads, head_dim) if method == "mean" else None
        with weights_zeroed(model, heads, head_dim, reference_means_):
            reference = reference_metric(model, ids, baseline_out, causal)
        assert entry.loss == pytest.approx(reference, abs=1e-4), (kind, method, heads)
    # the context manager gives the same numbers as the sweep
    with ablate(model, together, method=method, statistics=means):
        inside = reference_metric(model, ids, baseline_out, causal)
    assert inside == pytest.approx(result.groups[0].loss, abs=1e-5)
    assert reference_metric(model, ids, baseline_out, causal) == pytest.approx(expected_baseline, abs=1e-6)


def test_real_model_deltas_equal_zeroed_weights(smollm2: LoadedModel) -> None:
    """SmolLM2 (grouped-query llama): a few heads across the depth, exact sweep vs weight zeroing."""
    probe_set = natural_set(smollm2, seq_len=24, num_seqs=1)
    heads = [(0, 3), (1, 4), (14, 0), (29, 8)]
    result = sweep(smollm2, probe_set, heads)
    assert result.path.startswith("exact")
    ids = probe_set.input_ids
    for entry in result.heads:
        with weights_zeroed(smollm2.model, list(entry.heads), 64):
            reference = reference_metric(smollm2.model, ids, None, True)
        assert entry.loss == pytest.approx(reference, abs=1e-4)
    assert result.baseline_loss == pytest.approx(reference_metric(smollm2.model, ids, None, True), abs=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# the planted induction circuit


@pytest.mark.slow
@pytest.mark.parametrize("factory", [planted_textbook, planted_mha])
def test_removing_the_induction_circuit_destroys_the_second_repeat_advantage(factory) -> None:
    loaded = planted_loaded(factory)
    probe_set = repeated_set(loaded, repeat_len=20, num_seqs=4)
    result = sweep(loaded, probe_set)
    base = result.baseline_parts
    advantage = base["first_repeat"] - base["second_repeat"]
    assert advantage > 3.0  # the intact model copies the second repeat
    by_head = {r.heads[0]: r for r in result.heads}
    for head in [(1, 1), (0, 0)]:  # the induction head, and the previous-token head that feeds it
        ablated = by_head[head]
        assert ablated.parts["first_repeat"] - ablated.parts["second_repeat"] < 0.2 * advantage, head
        assert ablated.part_deltas["second_repeat"] > 0.8 * advantage
    for head in UNRELATED + [(0, 1)]:  # heads that write where nothing reads
        assert by_head[head].delta == pytest.approx(0.0, abs=1e-6), head
        assert by_head[head].parts["second_repeat"] == pytest.approx(base["second_repeat"], abs=1e-6)
    ranked = [r.heads[0] for r in result.ranked()]
    assert set(ranked[:2]) == {(1, 1), (0, 0)}


# ---------------------------------------------------------------------------------------------------------------
# exact == naive, resume


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama_gqa", "gpt2", "bert", "planted_textbook", "planted_mha"])
@pytest.mark.parametrize("method", ["zero", "mean"])
def test_exact_sweep_equals_naive_loop(kind: str, method: str) -> None:
    loaded = planted_loaded(planted_mha if kind == "planted_mha" else planted_textbook) \
        if kind.startswith("planted") else tiny_loaded(kind)
    probe_set = small_set(loaded, seqs=5)
    groups = [[(0, 1), (1, 0)]]
    heads = all_heads(loaded.model)  # with groups, the heads to ablate alone must be named
    naive = sweep(loaded, probe_set, heads, groups=groups, method=method, mode="naive", batch_size=2)
    exact = sweep(loaded, probe_set, heads, groups=groups, method=method, mode="exact", batch_size=2, stack=3)
    assert naive.path.startswith("naive") and exact.path.startswith("exact")
    assert [r.heads for r in exact.results] == [r.heads for r in naive.results]
    assert len(exact.heads) == 8 and len(exact.groups) == 1
    assert exact.baseline_loss == naive.baseline_loss
    for a, b in zip(exact.results, naive.results):
        assert a.loss == pytest.approx(b.loss, abs=1e-4)
        for name in a.parts:
            assert a.parts[name] == pytest.approx(b.parts[name], abs=1e-4)


@pytest.mark.parametrize("kind", ["llama_gqa", "gemma2"])
def test_exact_sweep_loss_from_the_decoder_output(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The exact sweep unembeds the decoder's output itself only where that gives the model's logits: Llama yes,
    Gemma 2 (logits soft-capped after the head, here at 0.5 so that the cap bends them) no; the losses equal the
    naive loop's either way."""
    from probe.ablation import blocks as ablate_module

    model = tiny_hf(kind)
    if kind == "gemma2":
        model.config.final_logit_softcapping = 0.5
    loaded = LoadedModel(model=model, tokenizer=None, name=f"tiny-{kind}", vocab_size=model.config.vocab_size)
    calls = []
    original = ablate_module.head_values
    monkeypatch.setattr(ablate_module, "head_values", lambda *args: calls.append(1) or original(*args))
    probe_set = small_set(loaded, seqs=4)
    naive = sweep(loaded, probe_set, mode="naive")
    exact = sweep(loaded, probe_set, mode="exact")
    assert exact.path.startswith("exact") and bool(calls) == (kind == "llama_gqa")
    for a, b in zip(exact.results, naive.results):
        assert a.loss == pytest.approx(b.loss, abs=1e-5)


def test_per_position_mean_differs_from_the_overall_mean() -> None:
    loaded = planted_loaded()
    probe_set = small_set(loaded)
    overall = head_means(loaded, probe_set)
    positional = head_means(loaded, probe_set, per_position=True)
    assert overall.values[0].shape == (4, 256)
    assert positional.values[0].shape == (probe_set.input_ids.shape[1], 4, 256)
    torch.testing.assert_close(positional.values[0].mean(dim=0), overall.values[0], atol=1e-5, rtol=1e-5)
    a = sweep(loaded, probe_set, [(0, 0)], method="mean", statistics=overall)
    b = sweep(loaded, probe_set, [(0, 0)], method="mean", statistics=positional)
    assert a.heads[0].loss != pytest.approx(b.heads[0].loss, abs=1e-3)


def test_resume_after_interruption_gives_the_same_file(tmp_path: Path) -> None:
    loaded = tiny_loaded("llama_gqa")
    probe_set = small_set(loaded, seqs=4)
    whole = tmp_path / "whole.jsonl"
    reference = sweep(loaded, probe_set, results_path=whole, batch_size=2, stack=2)
    part = tmp_path / "part.jsonl"
    seen = []

    def stop_after_three(result: HeadResult) -> None:
        seen.append(result)
        if len(seen) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        sweep(loaded, probe_set, results_path=part, batch_size=2, stack=2, on_result=stop_after_three)
    _header, finished = read_results(part)
    assert len(finished) == 3
    with part.open("a") as file:  # a line cut short by the interruption
        file.write('{"layer": 1, "head": 0, "lo')
    done_again = []
    resumed = sweep(loaded, probe_set, results_path=part, resume=True, batch_size=2, stack=2,
                    on_result=done_again.append)
    assert {r.heads for r in done_again}.isdisjoint({r.heads for r in finished})  # finished heads not redone
    assert len(done_again) == 8 - 3  # the chunk in flight is rerun whole; its finished head is not written again
    assert part.read_text() == whole.read_text()
    assert resumed.to_dict() | {"seconds": 0} == reference.to_dict() | {"seconds": 0}
    merged = load_results(part)
    assert [r.to_dict() for r in merged.results] == [r.to_dict() for r in reference.results]


def test_resume_refuses_a_different_sweep(tmp_path: Path) -> None:
    loaded = tiny_loaded("llama_gqa")
    path = tmp_path / "sweep.jsonl"
    sweep(loaded, small_set(loaded), [(0, 0)], results_path=path)
    with pytest.raises(ProbeError, match="another probe set: .*3 sequences.*, not .*2 sequences"):
        sweep(loaded, small_set(loaded, seqs=2), [(0, 1)], results_path=path, resume=True)
    with pytest.raises(ProbeError, match="not a probe ablation results file"):
        (tmp_path / "other.jsonl").write_text('{"hello": 1}\n')
        sweep(loaded, small_set(loaded), [(0, 1)], results_path=tmp_path / "other.jsonl", resume=True)


# ---------------------------------------------------------------------------------------------------------------
# the model is left exactly as it was


def fingerprint(model: torch.nn.Module) -> dict:
    digest = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    hooks = {}
    for name, module in model.named_modules():
        hooks[name] = (list(module._forward_hooks), list(module._forward_pre_hooks),
                       list(getattr(module, "_forward_hooks_with_kwargs", {})),
                       list(getattr(module, "_backward_hooks", {})), "forward" in module.__dict__,
                       "_probe_hooks" in module.__dict__, module.training,
                       tuple(p.requires_grad for p in module.parameters(recurse=False)))
    configs = [(m.config._attn_implementation_internal) for m in model.modules()
               if hasattr(getattr(m, "config", None), "_attn_implementation_internal")]
    return {"weights": digest.hexdigest(), "hooks": hooks, "configs": configs,
            "grads": [p.grad is None for p in model.parameters()]}


class Bomb(Exception):
    pass


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama_gqa", "planted_textbook", "planted_mha"])
@pytest.mark.parametrize("when", [1, 3, 5, 8])
@pytest.mark.parametrize("error", [Bomb, KeyboardInterrupt])
def test_model_is_restored_after_an_interrupted_sweep(kind: str, when: int, error: type) -> None:
    loaded = planted_loaded(planted_mha if kind == "planted_mha" else planted_textbook) \
        if kind.startswith("planted") else tiny_loaded(kind)
    model = loaded.model
    probe_set = small_set(loaded)
    attention_layers(model)  # discovery, before the snapshot
    before = fingerprint(model)
    with torch.no_grad():
        outputs = logits_of(run_model(model, probe_set.input_ids))
    calls = [0]
    block = attention_layers(model)[1].module

    def explode(_module, _args):
        calls[0] += 1
        if calls[0] == when:  # inside the hooks: baseline capture, the check, a stacked forward ...
            raise error("stop")

    handle = block.register_forward_pre_hook(explode)
    try:
        with pytest.raises(error):
            sweep(loaded, probe_set, method="mean", batch_size=2, stack=2)
    finally:
        handle.remove()
    assert fingerprint(model) == before
    with torch.no_grad():
        assert torch.equal(logits_of(run_model(model, probe_set.input_ids)), outputs)


@pytest.mark.parametrize("kind", ["llama_gqa", "gpt2", "planted_textbook"])
def test_model_is_restored_after_every_mode(kind: str, tmp_path: Path) -> None:
    loaded = planted_loaded() if kind.startswith("planted") else tiny_loaded(kind)
    model = loaded.model
    probe_set = small_set(loaded)
    attention_layers(model)
    before = fingerprint(model)
    sweep(loaded, probe_set, results_path=tmp_path / "a.jsonl")
    sweep(loaded, probe_set, mode="naive", method="mean")
    estimate(loaded, probe_set, refine=2)
    with ablate(model, [(0, 1), (1, 0)]):
        pass
    with pytest.raises(Bomb), ablate(model, [(0, 1)]):
        raise Bomb
    assert fingerprint(model) == before


# ---------------------------------------------------------------------------------------------------------------
# fallbacks


class Unlisted(torch.nn.Module):
    """The planted model with its layers as plain attributes, not a ModuleList: no block list to reuse."""

    def __init__(self) -> None:
        super().__init__()
        planted = planted_textbook()
        self.vocab_size = planted.vocab_size
        self.first, self.second = planted.layers
        self._embed = planted

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        planted = self._embed
        b, n = ids.shape
        x = torch.zeros(b, n, 1024)
        x[..., :200] = F.one_hot(ids, 200).float()
        x[..., 200:200 + n] = torch.eye(n)
        x[..., 856] = 1.0
        for layer in (self.first, self.second):
            x = x + layer(x)[0]
        return x[..., 656:856] * planted.unembed_scale


class Counting(PlantedModel):
    """A model whose output depends on how often it ran: reusing kept block outputs cannot reproduce it."""

    def __init__(self) -> None:
        super().__init__(list(planted_textbook().layers))
        self.calls = 0
        self.layers[0].register_forward_hook(self._count)

    def _count(self, _module, _args, output):
        self.calls += 1
        return output[0] + 1e-2 * self.calls, output[1]


def test_models_without_a_block_list_or_with_state_fall_back_to_the_naive_loop() -> None:
    reference = sweep(planted_loaded(), small_set(planted_loaded()), mode="naive")
    unlisted = LoadedModel(model=Unlisted().eval(), tokenizer=None, name="unlisted", vocab_size=200)
    result = sweep(unlisted, small_set(unlisted))
    assert result.path.startswith("naive") and "list of blocks" in result.path
    for a, b in zip(result.results, reference.results):
        assert a.loss == pytest.approx(b.loss, abs=1e-5)
    counting = LoadedModel(model=Counting().eval(), tokenizer=None, name="counting", vocab_size=200)
    result = sweep(counting, small_set(counting))
    assert "failed its check" in result.path


# ---------------------------------------------------------------------------------------------------------------
# estimate mode


def test_estimate_terms_and_exact_refinement() -> None:
    loaded = tiny_loaded("llama_gqa")
    model = loaded.model
    probe_set = small_set(loaded, seqs=4)
    ids = probe_set.input_ids
    exact = {r.heads[0]: r for r in sweep(loaded, probe_set).heads}
    est = estimate(loaded, probe_set, samples=2, refine=0)
    assert est.mode == "estimate" and est.forwards == pytest.approx(GRAD_FORWARD_COST + BACKWARD_COST * 3)
    assert est.baseline_loss == pytest.approx(sweep(loaded, probe_set, [(0, 0)]).baseline_loss, abs=1e-6)
    # the first-order term is the derivative of the loss along the ablation, -dL/ds at s = 0 of z_h -> (1 - s) z_h
    module, _ = projection(model, 1)
    eps = 1e-2  # central differences: float32 rounding stays well under the tolerance
    for head in (0, 3):
        losses = []
        for s in (-eps, eps):
            def scale(_m, args, s=s, head=head):
                x = args[0].clone()
                x[..., head * 16:(head + 1) * 16] *= (1 - s)
                return (x,)
            handle = module.register_forward_pre_hook(scale)
            losses.append(reference_metric(model, ids, None, True))
            handle.remove()
        derivative = (losses[1] - losses[0]) / (2 * eps)
        assert est.terms[(1, head)][0] == pytest.approx(derivative, rel=2e-2, abs=1e-5)
        assert est.terms[(1, head)][1] >= 0  # the Gauss-Newton term is a sum of squares
        assert est.heads[4 + head].delta == pytest.approx(sum(est.terms[(1, head)]), abs=1e-9)
    # refining every head exactly gives the exact sweep
    refined = estimate(loaded, probe_set, refine=8)
    assert all(r.exact for r in refined.heads)
    for r in refined.heads:
        assert r.delta == pytest.approx(exact[r.heads[0]].delta, abs=1e-5)
    # within a budget: the heads ranked highest are the exact ones, the rest estimated
    budget = GRAD_FORWARD_COST + BACKWARD_COST * 2 + 1.5
    partly = estimate(loaded, probe_set, budget=budget)
    assert 0 < sum(r.exact for r in partly.heads) < 8
    assert partly.forwards <= budget + 1e-9
    with pytest.raises(ProbeError, match="next-token loss"):
        estimate(tiny_loaded("bert"), small_set(tiny_loaded("bert")))



def test_estimate_progress_counts_forward_equivalents_of_its_whole_plan() -> None:
    """The estimate's progress is in forward-equivalents of one batch (WORK_UNITS each), its total the whole plan from
    the first report (the budget bounds the exact runs), only lowered once the heads to refine are chosen, so a time
    left is honest from the first pass; it ends at its total, which equals the forwards it reports."""
    loaded = tiny_loaded("llama_gqa")
    probe_set = small_set(loaded, seqs=4)
    for options in ({"budget": GRAD_FORWARD_COST + BACKWARD_COST * 2 + 1.5}, {"refine": 3}, {"refine": 0}):
        seen: list[tuple[int, int]] = []
        result = estimate(loaded, probe_set, progress=lambda done, total: seen.append((done, total)), **options)
        first_total = seen[0][1]
        assert seen[0][0] == round(GRAD_FORWARD_COST * WORK_UNITS)  # the first pass, at its weight, of the plan
        assert all(total <= first_total for _, total in seen)  # the plan only shrinks
        assert [done for done, _ in seen] == sorted(done for done, _ in seen)
        assert seen[-1][0] == seen[-1][1] == pytest.approx(result.forwards * WORK_UNITS, abs=2)  # one batch
        if "budget" in options:
            assert first_total == round(options["budget"] * WORK_UNITS)


# ---------------------------------------------------------------------------------------------------------------
# results, the command line, bad input


def test_result_schema_csv_and_html(tmp_path: Path) -> None:
    loaded = planted_loaded()
    result = sweep(loaded, small_set(loaded), [(0, 0), (1, 1)], groups=[[(0, 0), (1, 1)]])
    data = result.to_dict()
    assert {"model", "method", "data", "baseline_loss", "heads", "n_layers", "n_heads", "metric"} <= set(data)
    assert (data["method"], data["data"], data["n_layers"], data["n_heads"]) == ("zero", "repeated", 2, 4)
    assert [(h["layer"], h["head"]) for h in data["heads"]] == [(0, 0), (1, 1)]
    assert all(isinstance(h["loss"], float) and isinstance(h["delta"], float) for h in data["heads"])
    assert data["groups"][0]["heads"] == [[0, 0], [1, 1]]
    json.dumps(data)
    write_csv(tmp_path / "r.csv", result.csv_rows())
    lines = (tmp_path / "r.csv").read_text().splitlines()
    assert lines[0].startswith("name,loss,delta,first_repeat_loss")  # a group among them: no layer, head
    assert len(lines) == 4
    page = result._repr_html_()  # a notebook output: a fragment, not a document
    assert "planted_textbook" in page and "<html" not in page.lower() and "<meta" not in page.lower()


def test_parse_heads() -> None:
    layers = attention_layers(planted_textbook())
    assert parse_heads("0.1, 1.3", layers) == [(0, 1), (1, 3)]
    assert parse_heads("1.*", layers) == [(1, h) for h in range(4)]
    assert parse_heads("1", layers) == [(1, h) for h in range(4)]
    assert parse_heads("0-1.2-3", layers) == [(0, 2), (0, 3), (1, 2), (1, 3)]
    assert len(parse_heads("all", layers)) == 8
    assert parse_heads("0.1,0.1", layers) == [(0, 1)]
    for spec, message in [("0.4", "head 4 .* out of range: the layer has 4 heads"),
                          ("2.0", "layer 2 .* out of range: the model has 2 layers"),
                          ("a.b", "malformed head 'a.b'"), ("0.1,,1.2", "malformed heads"),
                          ("1.2.3", "malformed head"), ("", "malformed heads"), ("1-0.0", "runs backwards")]:
        with pytest.raises(ProbeError, match=message):
            parse_heads(spec, layers)


def test_bad_input_in_the_library() -> None:
    loaded = planted_loaded()
    probe_set = small_set(loaded)
    with pytest.raises(ProbeError, match="out of range"):
        sweep(loaded, probe_set, [(0, 9)])
    with pytest.raises(ProbeError, match="out of range"):
        sweep(loaded, probe_set, groups=[[(0, 0), (5, 0)]])
    with pytest.raises(ProbeError, match="at least 2 tokens"):
        sweep(loaded, ProbeSet("natural", "one token", torch.tensor([[3]]), 1))
    with pytest.raises(ProbeError, match="unknown ablation method"):
        sweep(loaded, probe_set, method="half")
    with pytest.raises(ProbeError, match="batch_size"):
        sweep(loaded, probe_set, batch_size=0)


PLANTED = f"{TESTS / 'planted.py'}:planted_textbook"


def test_cli_sweep_json_csv_and_resume(tmp_path: Path, capsys, monkeypatch) -> None:
    out, csv, results = tmp_path / "a.json", tmp_path / "a.csv", tmp_path / "a.jsonl"
    args = ["ablate", "--model", PLANTED, "--data", "repeated", "--num-seqs", "3", "--repeat-len", "12"]
    code, stdout, stderr = run_cli([*args, "--json", str(out), "--csv", str(csv), "--results", str(results)],
                                   capsys, monkeypatch)
    assert code == 0, stderr
    assert "Heads whose removal hurts most" in stdout and "baseline loss" in stdout
    assert "1.1" in stdout and "0.0" in stdout
    data = json.loads(out.read_text())
    assert len(data["heads"]) == 8 and data["method"] == "zero" and data["data"] == "repeated"
    assert csv.read_text().count("\n") == 9  # the header, 8 heads (the provenance is in a.provenance.json)
    # the same command again: the results file exists
    code, _, stderr = run_cli([*args, "--results", str(results)], capsys, monkeypatch)
    assert code == 2 and "--resume" in stderr and len(stderr.strip().splitlines()) == 1
    # resumed: nothing left to do, the same numbers
    code, stdout, stderr = run_cli([*args, "--results", str(results), "--resume", "--json", str(tmp_path / "b.json")],
                                   capsys, monkeypatch)
    assert code == 0, stderr
    assert "resumed: 8" in stderr
    first, second = json.loads(out.read_text()), json.loads((tmp_path / "b.json").read_text())
    assert first["heads"] == second["heads"]


def test_cli_together_mean_and_estimate(tmp_path: Path, capsys, monkeypatch) -> None:
    args = ["ablate", "--model", PLANTED, "--data", "repeated", "--num-seqs", "3", "--repeat-len", "12"]
    code, stdout, stderr = run_cli([*args, "--heads", "0.0,1.1", "--together", "--json", str(tmp_path / "t.json")],
                                   capsys, monkeypatch)
    assert code == 0, stderr
    assert "Heads ablated together" in stdout and "0.0+1.1" in stdout
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["heads"] == [] and data["groups"][0]["heads"] == [[0, 0], [1, 1]]
    code, stdout, stderr = run_cli([*args, "--method", "mean", "--per-position", "--heads", "1.*"], capsys,
                                   monkeypatch)
    assert code == 0, stderr
    assert "per-position mean" in stdout
    code, stdout, stderr = run_cli([*args, "--method", "estimate", "--json", str(tmp_path / "e.json")], capsys,
                                   monkeypatch)
    assert code == 0, stderr
    estimated = json.loads((tmp_path / "e.json").read_text())
    assert estimated["mode"] == "estimate" and "forward_equivalents" in estimated


@pytest.mark.parametrize("args, message", [
    (["--heads", "0.7"], "head 7 in --heads '0.7' is out of range"),
    (["--heads", "9.0"], "layer 9 in --heads '9.0' is out of range"),
    (["--heads", "0.x"], "malformed head '0.x'"),
    (["--heads", "0.1;1.2"], "malformed head"),
    (["--method", "half"], "--method 'half'"),
    (["--together"], "--together needs --heads"),
    (["--per-position"], "--per-position applies to --method mean"),
    (["--data", "missing.txt"], "not found"),
    (["--seq-len", "1"], "--seq-len must be at least 2"),
])
def test_cli_bad_input_is_one_line(args: list[str], message: str, capsys, monkeypatch) -> None:
    code, _, stderr = run_cli(["ablate", "--model", PLANTED, *args], capsys, monkeypatch)
    assert code == 2
    assert len(stderr.strip().splitlines()) == 1, stderr
    assert message in stderr


@pytest.mark.parametrize("flag", ["--task", "--labels"])
def test_cli_estimate_with_a_task_names_every_registered_method(flag: str, tmp_path: Path, capsys,
                                                                monkeypatch) -> None:
    labels = tmp_path / "labels.jsonl"
    labels.write_text('{"text": "a b", "label": 0}\n')
    value = "sva" if flag == "--task" else str(labels)
    code, _, stderr = run_cli(["ablate", "--model", PLANTED, "--method", "estimate", flag, value], capsys, monkeypatch)
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert f"use another --method ({', '.join(METHODS)}) with {flag}" in stderr


def test_cli_seq2seq_help_names_the_methods_that_sweep_pairs() -> None:
    from probe.cli.ablate import Seq2seq

    usable = [name for name, method in METHODS.items() if not method.across_sequences]
    assert usable and f"(--method {' or '.join(usable)})" in Seq2seq.__metadata__[0].help


def test_cli_empty_and_too_short_data_files(tmp_path: Path, capsys, monkeypatch, smollm2) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    code, _, stderr = run_cli(["ablate", "--model", PLANTED, "--data", str(empty)], capsys, monkeypatch)
    assert code == 2 and "is empty" in stderr and len(stderr.strip().splitlines()) == 1
    short = tmp_path / "short.txt"
    short.write_text("Hi")
    monkeypatch.setattr("probe.cli.options.load", lambda *args, **kwargs: smollm2)  # the session's model, not a reload
    code, _, stderr = run_cli(["ablate", "--data", str(short), "--seq-len", "4"], capsys, monkeypatch)
    assert code == 2 and "fewer than one chunk" in stderr and len(stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------------------------------
# pinned before the ablation code was split into probe/ablation/ (numbers must not move)


@pytest.mark.parametrize("kind", ["llama_gqa", "gpt2", "planted_textbook"])
def test_exact_sweep_equals_naive_loop_for_per_position_means(kind: str) -> None:
    loaded = planted_loaded() if kind.startswith("planted") else tiny_loaded(kind)
    probe_set = small_set(loaded, seqs=5)
    means = head_means(loaded, probe_set, per_position=True, batch_size=2)
    naive = sweep(loaded, probe_set, method="mean", statistics=means, mode="naive", batch_size=2)
    exact = sweep(loaded, probe_set, method="mean", statistics=means, mode="exact", batch_size=2, stack=3)
    assert naive.path.startswith("naive") and exact.path.startswith("exact")
    assert exact.baseline_loss == naive.baseline_loss
    for a, b in zip(exact.results, naive.results):
        assert a.heads == b.heads and a.loss == pytest.approx(b.loss, abs=1e-4)


def first_order_terms(model: torch.nn.Module, ids: torch.Tensor, head_dim: int) -> dict[tuple[int, int], float]:
    """Attribution patching written out: each head's -<dL/dz_h, z_h>, with z_h its slice of the output projection's
    input and L the plain forward's next-token cross-entropy (the mean over every position), by autograd (the total
    derivative: a later layer's input stays a function of an earlier one's)."""
    layers = len(attention_layers(model))
    inputs: dict[int, torch.Tensor] = {}

    def keep(layer: int):
        def pre_hook(_module, args):
            inputs[layer] = args[0] if args[0].requires_grad else args[0].detach().requires_grad_(True)
            return (inputs[layer], *args[1:])
        return pre_hook

    handles = [projection(model, layer)[0].register_forward_pre_hook(keep(layer)) for layer in range(layers)]
    try:
        logits = logits_of(run_model(model, ids)).float()
    finally:
        for handle in handles:
            handle.remove()
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    grads = torch.autograd.grad(loss, [inputs[layer] for layer in range(layers)])
    products = [-(grad * inputs[layer].detach()) for layer, grad in enumerate(grads)]
    return {(layer, head): float(products[layer][..., head * head_dim:(head + 1) * head_dim].sum())
            for layer in range(layers) for head in range(inputs[layer].shape[-1] // head_dim)}


def test_estimate_numbers_equal_an_independent_computation() -> None:
    """The estimate's numbers, each derived here another way: its baseline is the plain forward's cross-entropy, its
    first-order deltas are autograd's -<dL/dz_h, z_h> (batches of 3 and 1 sequences summed as one mean), and a head
    it refines has the delta of zeroing that head's columns of the output projection."""
    loaded = tiny_loaded("llama_gqa")
    model, head_dim = loaded.model, 64 // 4
    probe_set = small_set(loaded, seqs=4)
    ids = probe_set.input_ids
    baseline = reference_metric(model, ids, None, True)
    first = estimate(loaded, probe_set, samples=0, refine=0, batch_size=3)
    assert first.baseline_loss == pytest.approx(baseline, rel=1e-6)
    assert not any(result.exact for result in first.results)
    assert {result.heads[0]: result.delta for result in first.results} == pytest.approx(
        first_order_terms(model, ids, head_dim), abs=1e-6)
    refined = estimate(loaded, probe_set, samples=2, refine=2, batch_size=3)
    exact = [result for result in refined.results if result.exact]
    assert len(exact) == 2
    for result in exact:
        with weights_zeroed(model, list(result.heads), head_dim):
            assert result.delta == pytest.approx(reference_metric(model, ids, None, True) - baseline, abs=1e-5)


def test_second_order_labels_follow_the_softmax_and_barely_move_with_rounding(monkeypatch: pytest.MonkeyPatch
                                                                            ) -> None:
    """Gumbel-max draws (the estimate's second order): each label as often as its probability, in chunks as in one
    piece; the logits rounded to bfloat16 change few labels (the inverse CDF changed about a third on SmolLM2)."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).repeat(40000, 1)
    drawn = gumbel_draws(logits, torch.Generator().manual_seed(0))
    frequencies = torch.bincount(drawn[:, 0], minlength=4).double() / len(drawn)
    assert frequencies.tolist() == pytest.approx([0.5, 0.3, 0.15, 0.05], abs=0.01)
    wide = torch.randn(64, 5000, generator=torch.Generator().manual_seed(1)) * 3
    whole = gumbel_draws(wide, torch.Generator().manual_seed(2))
    module = importlib.import_module("probe.ablation.estimate")  # (probe.ablation.estimate is also the function)
    monkeypatch.setattr(module, "GUMBEL_CHUNK", 5000 * 7)  # 7 rows at a time: the same noise
    assert torch.equal(gumbel_draws(wide, torch.Generator().manual_seed(2)), whole)
    monkeypatch.undo()
    rounded = gumbel_draws(wide.bfloat16().float(), torch.Generator().manual_seed(2))
    assert (rounded == whole).double().mean() > 0.9


# ---------------------------------------------------------------------------------------------------------------
# issue 18: a malformed results file says so in one line; a second Ctrl-C during clean-up leaves nothing behind


def test_a_malformed_results_entry_names_the_file_and_line(tmp_path: Path, capsys, monkeypatch) -> None:
    loaded = planted_loaded()
    path = tmp_path / "r.jsonl"
    sweep(loaded, small_set(loaded), [(0, 0), (1, 1)], results_path=path)
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], '{"loss": 1.0, "delta": 0.5}', lines[2]]) + "\n")
    for call in (lambda: read_results(path), lambda: sweep(loaded, small_set(loaded), results_path=path, resume=True)):
        with pytest.raises(ProbeError, match=r"r.jsonl line 2 is malformed: the ablation entry has no 'heads'; "
                                             r"remove that line"):
            call()
    code, _, stderr = run_cli(["ablate", "--model", PLANTED, "--results", str(path), "--resume"], capsys,
                              monkeypatch)
    error_lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert code == 2 and len(error_lines) == 1 and "line 2 is malformed" in error_lines[0]
    assert "KeyError" not in stderr and "Traceback" not in stderr


@pytest.mark.parametrize("when", [2, 8])  # the baseline's block capture; a stacked forward with blocks skipped
def test_a_second_interrupt_during_clean_up_leaves_no_hook(when: int, monkeypatch: pytest.MonkeyPatch) -> None:
    import signal

    from torch.utils.hooks import RemovableHandle

    from probe.ablation import blocks

    loaded = tiny_loaded("llama_gqa")
    model = loaded.model
    probe_set = small_set(loaded)
    attention_layers(model)
    before = fingerprint(model)
    with torch.no_grad():
        outputs = logits_of(run_model(model, probe_set.input_ids))
    calls, cleanups = [0], [0]

    def explode(_module, _args):
        calls[0] += 1
        if calls[0] == when:
            raise KeyboardInterrupt  # the first Ctrl-C, inside a hooked forward

    original_remove, original_put_back = RemovableHandle.remove, blocks.put_back

    def second_interrupt() -> None:
        cleanups[0] += 1
        if cleanups[0] == 1:
            signal.raise_signal(signal.SIGINT)  # the second one, landing inside the clean-up

    def remove(self):
        if self.id != handle.id:
            second_interrupt()
        original_remove(self)

    def put_back(module, name, saved):
        second_interrupt()
        original_put_back(module, name, saved)

    handle = attention_layers(model)[1].module.register_forward_pre_hook(explode)
    monkeypatch.setattr(RemovableHandle, "remove", remove)
    monkeypatch.setattr(blocks, "put_back", put_back)
    suite_handler = signal.signal(signal.SIGINT, signal.default_int_handler)  # its own Ctrl-C, not a user's
    try:
        with pytest.raises(KeyboardInterrupt):
            sweep(loaded, probe_set, batch_size=2, stack=2)
    finally:
        signal.signal(signal.SIGINT, suite_handler)
        monkeypatch.undo()
        handle.remove()
    assert cleanups[0] >= 1
    assert fingerprint(model) == before
    with torch.no_grad():
        assert torch.equal(logits_of(run_model(model, probe_set.input_ids)), outputs)


class SequenceMean(AblationMethod):
    """A method of one's own, resample-like: each ablated head takes the mean of its batch's sequences."""

    name = "sequence_mean"

    def __init__(self, means: object = None) -> None:  # the constructor METHODS entries share
        self.seen: set[int | None] = set()

    def replacement(self, heads: torch.Tensor, ctx: HookContext) -> torch.Tensor:
        self.seen.add(None if ctx.batch is None else ctx.batch.index)
        return heads.mean(dim=0, keepdim=True)  # (1, positions, n_heads, head_dim): other sequences' values


def test_a_method_of_ones_own_is_one_class() -> None:
    """A new ablation method is one AblationMethod subclass: sweep takes the object, its numbers follow its
    replacement, and exact equals naive."""
    loaded = planted_loaded()
    probe_set = small_set(loaded)
    method = SequenceMean()
    exact = sweep(loaded, probe_set, method=method, batch_size=2)
    naive = sweep(loaded, probe_set, method=SequenceMean(), mode="naive", batch_size=2)
    zero = sweep(loaded, probe_set, batch_size=2)
    assert exact.method == "sequence_mean" and method.seen == {0, 1} and "naive" not in exact.path
    for mine, reference in zip(exact.results, naive.results):
        assert mine.loss == pytest.approx(reference.loss, rel=1e-5, abs=1e-6)
    assert any(mine.loss != pytest.approx(zeroed.loss, rel=1e-4) for mine, zeroed in zip(exact.results, zero.results))


def test_a_registered_method_is_a_command_line_choice(tmp_path: Path, capsys, monkeypatch) -> None:
    """One entry in METHODS makes the method a `--method` of `probe ablate`, with nothing else to change."""
    monkeypatch.setitem(METHODS, "sequence_mean", SequenceMean)
    out = tmp_path / "r.json"
    code, _, stderr = run_cli(["ablate", "--model", PLANTED, "--method", "sequence_mean", "--heads", "0.1,1.2",
                               "--json", str(out)], capsys, monkeypatch)
    assert code == 0, stderr
    payload = json.loads(out.read_text())
    assert payload["method"] == "sequence_mean" and len(payload["heads"]) == 2
    monkeypatch.delitem(METHODS, "sequence_mean")
    code, _, stderr = run_cli(["ablate", "--model", PLANTED, "--method", "sequence_mean"], capsys, monkeypatch)
    assert code == 2 and f"use one of {', '.join([*METHODS, 'estimate'])}" in stderr

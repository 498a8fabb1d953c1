"""Issue 26, registries in fact: methods and metrics declare what they need, and callers ask them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli
from test_specific import WORDS, words_loaded, write_rows
from words import PROMPTS

import torch

from probe.ablation import ablate, blocks as readouts, sweep
from probe.ablation.methods import NoiseAblation, build_method, derangement
from probe.ablation.statistics import head_statistics
from probe.hooks.run import run_model
from probe.inputs import task_set


def test_a_long_task_set_scores_the_task_margin_as_the_short_path_does(tmp_path: Path, monkeypatch) -> None:
    """Logits over the chunking threshold must not turn the task margin into plain cross-entropy."""
    loaded = words_loaded()
    prompts = write_rows(tmp_path / "prompts.jsonl", [{"prompt": p, "answer": a, "distractor": d}
                                                      for p, a, d in PROMPTS])
    probe_set = task_set(loaded, prompts)
    heads = [(0, 1), (1, 2)]
    for mode in ("exact", "naive"):
        short = sweep(loaded, probe_set, heads, mode=mode, batch_size=4)
        monkeypatch.setattr(readouts, "LOGITS_BYTES", 0)  # every batch's logits count as too large
        long = sweep(loaded, probe_set, heads, mode=mode, batch_size=4)
        monkeypatch.undo()
        assert long.metric == short.metric == "task_margin"
        assert long.task == pytest.approx(short.task, abs=1e-5)
        assert long.baseline_loss == pytest.approx(short.baseline_loss, abs=1e-5)
        for a, b in zip(short.results, long.results):
            assert a.task == pytest.approx(b.task, abs=1e-5) and a.loss == pytest.approx(b.loss, abs=1e-5)


def test_the_resample_derangement_follows_the_seed(tmp_path: Path, capsys, monkeypatch) -> None:
    out = tmp_path / "r.json"
    code, _, stderr = run_cli(["ablate", "--model", WORDS, "--task", "sva", "--num-seqs", "6", "--method",
                               "resample", "--seed", "3", "--heads", "0.1", "--json", str(out)], capsys, monkeypatch)
    assert code == 0, stderr
    described = json.loads(out.read_text())["mean"]
    assert "seed 3" in described
    # 12 rows: 6 pairs, two rows each, one batch of 8 and one of 4
    donors = derangement(8, torch.Generator().manual_seed(3 * 1_000_003 + 1))
    assert " ".join(str(int(d)) for d in donors) in described


def test_a_metric_the_chunked_readout_cannot_serve_is_read_from_full_logits(monkeypatch) -> None:
    """Over the chunking threshold, a metric that compares whole outputs (cosine distance on a causal LM) must still
    be computed as itself, not silently as cross-entropy."""
    from probe.ablation.prune import prune
    from test_long_context import _sets
    from conftest import tiny_loaded

    loaded = tiny_loaded("llama_gqa")
    natural, _ = _sets(loaded, length=40, num=3)
    short = prune(loaded, natural, orderings=("random",), seeds=(0,), step=0.5, metric="cosine_distance",
                  batch_size=2)
    monkeypatch.setattr(readouts, "LOGITS_BYTES", 0)
    long = prune(loaded, natural, orderings=("random",), seeds=(0,), step=0.5, metric="cosine_distance",
                 batch_size=2)
    assert long.baseline_loss == pytest.approx(short.baseline_loss, abs=1e-6) == 0.0
    assert [s.loss for s in long.curves[0].steps] == pytest.approx([s.loss for s in short.curves[0].steps], abs=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# noise ablation: a method that reads a statistic of its own (std), added as one class and one statistic


def head_slices(model: torch.nn.Module, ids: torch.Tensor, layer: int, head: int, head_dim: int) -> torch.Tensor:
    """(tokens, head_dim) one head's input slice to the output projection at every position: a plain pre-hook."""
    from test_ablate import projection

    module, _ = projection(model, layer)
    seen = []
    handle = module.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach()))
    with torch.no_grad():
        run_model(model, ids)
    handle.remove()
    return seen[0].reshape(-1, seen[0].shape[-1])[:, head * head_dim:(head + 1) * head_dim]


def test_noise_ablation_is_the_mean_plus_seeded_noise_of_the_heads_std() -> None:
    from test_ablate import planted_loaded, projection, small_set

    loaded = planted_loaded()
    model, probe_set, head_dim = loaded.model, small_set(loaded), 256
    statistics = head_statistics(loaded, probe_set, ("mean", "std"), batch_size=8)
    values = head_slices(model, probe_set.input_ids, 1, 2, head_dim)
    torch.testing.assert_close(statistics.stats["mean"][1][2], values.mean(dim=0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(statistics.stats["std"][1][2], values.std(dim=0, unbiased=False), atol=1e-5, rtol=1e-4)
    method = build_method("noise", loaded, probe_set, seed=5)
    assert isinstance(method, NoiseAblation) and method.seed == 5
    shape = (*probe_set.input_ids.shape, 4, head_dim)
    draws = method.noise(1, torch.Size(shape), 0)
    assert torch.equal(draws, method.noise(1, torch.Size(shape), 0))  # fixed: every run of an ablation sees the same
    assert not torch.equal(draws, NoiseAblation(statistics, seed=6).noise(1, torch.Size(shape), 0))
    assert abs(float(draws.mean())) < 0.05 and abs(float(draws.std()) - 1) < 0.05
    outside_a_sweep = method.noise(1, torch.Size(shape), None)  # ablate() runs no batch of a sweep
    expected = values.mean(dim=0) + values.std(dim=0, unbiased=False) * outside_a_sweep[..., 2, :].reshape(-1, head_dim)
    module, _ = projection(model, 1)
    seen = []
    with ablate(model, [(1, 2)], method=method):  # probe's edit is a pre-hook too: this one runs after it
        handle = module.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach()))
        with torch.no_grad():
            run_model(model, probe_set.input_ids)
        handle.remove()
    replaced = seen[0].reshape(-1, seen[0].shape[-1])[:, 2 * head_dim:3 * head_dim]
    torch.testing.assert_close(replaced, expected, atol=1e-5, rtol=1e-4)


def test_noise_ablation_exact_equals_naive_and_the_cli_takes_it(tmp_path: Path, capsys, monkeypatch) -> None:
    from test_ablate import PLANTED, planted_loaded, small_set

    loaded = planted_loaded()
    probe_set = small_set(loaded, seqs=4)
    exact = sweep(loaded, probe_set, method="noise", batch_size=2, seed=1)
    naive = sweep(loaded, probe_set, method="noise", mode="naive", batch_size=2, seed=1)
    mean = sweep(loaded, probe_set, method="mean", batch_size=2)
    assert exact.path.startswith("exact") and exact.method == "noise" and "noise seed 1" in exact.mean
    assert [r.loss for r in exact.results] == pytest.approx([r.loss for r in naive.results], abs=1e-5)
    assert any(a.loss != pytest.approx(b.loss, abs=1e-4) for a, b in zip(exact.results, mean.results))
    out = tmp_path / "noise.json"
    code, _, stderr = run_cli(["ablate", "--model", PLANTED, "--method", "noise", "--per-position", "--heads",
                               "0.1,1.2", "--json", str(out)], capsys, monkeypatch)
    assert code == 0, stderr
    payload = json.loads(out.read_text())
    assert payload["method"] == "noise" and "per-position mean and std" in payload["mean"]


# ---------------------------------------------------------------------------------------------------------------
# the kl metric: a metric that reads full distributions, added as one class


def test_the_kl_metric_equals_a_hand_computation_and_is_chosen_by_name(tmp_path: Path, capsys, monkeypatch) -> None:
    from conftest import tiny_loaded
    from test_ablate import PLANTED, small_set, weights_zeroed

    from probe.hooks.run import logits_of

    loaded = tiny_loaded("llama_gqa")
    probe_set = small_set(loaded, seqs=4)
    ids = probe_set.input_ids
    heads = [(0, 1), (1, 3)]
    exact = sweep(loaded, probe_set, heads, metric="kl", batch_size=2)
    naive = sweep(loaded, probe_set, heads, metric="kl", mode="naive", batch_size=2)
    assert exact.metric == "kl" and exact.baseline_loss == 0.0 and exact.path.startswith("exact")
    with torch.no_grad():
        clean = logits_of(run_model(loaded.model, ids)).double()[:, :-1].log_softmax(-1)
    for entry, reference in zip(exact.results, naive.results):
        with weights_zeroed(loaded.model, list(entry.heads), 16), torch.no_grad():
            ablated = logits_of(run_model(loaded.model, ids)).double()[:, :-1].log_softmax(-1)
        by_hand = float((clean.exp() * (clean - ablated)).sum(-1).mean())
        assert entry.loss == pytest.approx(by_hand, abs=1e-6) and entry.loss > 0
        assert reference.loss == pytest.approx(entry.loss, abs=1e-6)
    out = tmp_path / "kl.json"
    code, _, stderr = run_cli(["ablate", "--model", PLANTED, "--metric", "kl", "--heads", "0.1,1.2", "--json",
                               str(out)], capsys, monkeypatch)
    assert code == 0, stderr
    assert json.loads(out.read_text())["metric"] == "kl"


def test_a_metric_outside_its_input_kind_is_one_line(capsys, monkeypatch) -> None:
    from conftest import tiny_loaded
    from test_ablate import small_set

    from probe.errors import ProbeError

    loaded = tiny_loaded("bert")
    with pytest.raises(ProbeError, match="metric kl applies to a causal LM's next-token predictions on text or a "
                                         "task set's scored positions, not to a model without next-token logits"):
        sweep(loaded, small_set(loaded), [(0, 1)], metric="kl")
    words = words_loaded()
    with pytest.raises(ProbeError, match="metric logit_diff applies to prompts each followed by their answer and "
                                         "distractor"):
        sweep(words, task_set(words, "ioi", count=4), [(0, 1)], metric="logit_diff")
    code, _, stderr = run_cli(["ablate", "--model", "tests/words.py:tiny_with_words", "--metric", "entropy"], capsys,
                              monkeypatch)
    from probe.ablation.metrics import METRICS

    assert code == 2 and f"--metric 'entropy': use one of {', '.join(METRICS)}" in " ".join(stderr.split())
    assert len(stderr.strip().splitlines()) == 1

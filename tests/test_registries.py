"""Issue 26, registries in fact: methods and metrics declare what they need, and callers ask them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli
from test_specific import WORDS, words_loaded, write_rows
from words import PROMPTS

from probe.ablate import sweep
from probe.ablation import logits as readouts
from probe.ablation.methods import ResampleAblation, derangement
from probe.tasks import task_set

import torch


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
    rows = 12  # 6 pairs, two rows each, one batch of 8 and one of 4
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

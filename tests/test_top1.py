"""The `top1` metric: 1 - top-1 accuracy of the next token, against a hand computation on a planted model whose
induction head alone predicts the second copy of a repeated sequence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from planted import HEAD_DIM
from test_ablate import PLANTED, planted_loaded, small_set, weights_zeroed

from probe.ablation import blocks as readouts, sweep
from probe.ablation.metrics import METRICS
from probe.hooks.run import logits_of, run_model


def _error(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, float]:
    """(error over every predicted position, error over the second copy's) by hand: argmax of the logits at t against
    the token at t + 1."""
    with torch.no_grad():
        wrong = (logits_of(run_model(model, ids))[:, :-1].argmax(-1) != ids[:, 1:]).double()
    copy = (ids.shape[1] - 1) // 2
    return float(wrong.mean()), float(wrong[:, -copy:].mean())


def test_top1_equals_a_hand_computation_on_every_path(monkeypatch) -> None:
    loaded = planted_loaded()
    probe_set = small_set(loaded, seqs=4)
    ids = probe_set.input_ids
    heads = [(1, 1), (0, 2)]  # the induction head, and a small random one
    exact = sweep(loaded, probe_set, heads, metric="top1", batch_size=2)
    naive = sweep(loaded, probe_set, heads, metric="top1", mode="naive", batch_size=2)
    monkeypatch.setattr(readouts, "LOGITS_BYTES", 0)  # every batch's logits read in chunks of positions
    chunked = sweep(loaded, probe_set, heads, metric="top1", batch_size=2)
    monkeypatch.undo()
    baseline, second = _error(loaded.model, ids)
    assert exact.metric == "top1" and exact.baseline_loss == pytest.approx(baseline, abs=1e-9)
    assert second < 0.1 and baseline > 0.3  # the second copy is predicted (but its first token), the first is not
    for entry, reference, long in zip(exact.results, naive.results, chunked.results):
        with weights_zeroed(loaded.model, list(entry.heads), HEAD_DIM):
            by_hand, _ = _error(loaded.model, ids)
        assert entry.loss == pytest.approx(by_hand, abs=1e-9)
        assert reference.loss == pytest.approx(by_hand, abs=1e-9) and long.loss == pytest.approx(by_hand, abs=1e-9)
    induction, random_head = exact.results
    assert induction.loss > baseline + 0.2 and random_head.loss == pytest.approx(baseline, abs=0.05)


def test_top1_is_chosen_by_name_on_the_command_line(tmp_path: Path, capsys, monkeypatch) -> None:
    out = tmp_path / "top1.json"
    code, stdout, stderr = run_cli(["ablate", "--model", PLANTED, "--data", "repeated", "--metric", "top1",
                                    "--heads", "1.1", "--json", str(out)], capsys, monkeypatch)
    assert code == 0, stderr
    payload = json.loads(out.read_text())
    assert payload["metric"] == "top1" and payload["heads"][0]["delta"] > 0
    assert not METRICS["top1"].default_for  # asked for by name: every default stays as it was

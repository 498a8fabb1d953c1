"""The `local` head class: attention in a narrow band on the diagonal, the previous token left out."""

from __future__ import annotations

from pathlib import Path

import torch

from probe import load_model
from probe.heads.classify import classify
from probe.heads.scores import LOCAL_WINDOW, SCORES

TESTS = Path(__file__).resolve().parent


def _two_back(model: torch.nn.Module) -> None:
    """Head 0.2 of the planted model made to attend two tokens back (query = position i, key = position j + 2)."""
    from planted import HEAD_DIM, MAX_LEN, POS, SHARP

    attention = model.layers[0]
    rows = slice(2 * HEAD_DIM, 3 * HEAD_DIM)
    with torch.no_grad():
        attention.W_q.weight[rows] = 0
        attention.W_k.weight[rows] = 0
        for i in range(MAX_LEN):
            attention.W_q.weight[rows.start + i, POS + i] = SHARP
        for j in range(MAX_LEN - 2):
            attention.W_k.weight[rows.start + j + 2, POS + j] = 1.0


def test_a_two_back_head_is_local_and_a_previous_token_head_is_not() -> None:
    loaded = load_model(f"{TESTS / 'planted.py'}:planted_textbook")
    _two_back(loaded.model)
    result = classify(loaded, scores=["local", "previous_token"], num_seqs=2, seq_len=32)
    local = result.scores["local"]
    assert local[0, 2] > 0.95  # its attention is all on i - 2, inside the band
    assert local[0, 0] < 0.05 and result.scores["previous_token"][0, 0] > 0.95  # i - 1 is left out of the band
    assert local[0, 1] < 0.05  # the sink head: key 0, outside the band once i >= LOCAL_WINDOW
    assert "local" in result.labels(0, 2) and "local" not in result.labels(0, 0)


def test_local_is_not_scored_by_default() -> None:
    """A class of its own, asked for by name: classify's default output stays as it was."""
    assert not SCORES["local"].by_default and LOCAL_WINDOW >= 2

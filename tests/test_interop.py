"""Interop: load_model takes a model already in memory (and its tokenizer); results become pandas DataFrames, with a
clear error where pandas is missing."""

from __future__ import annotations

import re
import sys

import pytest
import torch

from conftest import tiny_hf, tiny_loaded
from probe import classify, load_model
from probe.ablation import estimate, sweep
from probe.inputs import repeated_set
from probe.errors import ProbeError

pandas = pytest.importorskip("pandas")


def test_load_model_takes_a_module_as_it_is() -> None:
    model = tiny_hf("llama_gqa").train()
    loaded = load_model(model, name="my llama")
    assert loaded.model is model and not model.training  # used in place, in eval mode
    assert loaded.name == "my llama" and loaded.vocab_size == 120 and loaded.tokenizer is None
    reference = classify(tiny_loaded("llama_gqa"), seq_len=16, num_seqs=2, repeat_len=8)
    result = classify(loaded, seq_len=16, num_seqs=2, repeat_len=8)
    for name, score in reference.scores.items():  # the same weights as the string form's model: the same scores
        torch.testing.assert_close(result.scores[name], score)
    assert load_model(tiny_hf("gpt2"), tokenizer="tok").tokenizer == "tok"
    with pytest.raises(ProbeError, match="device_map"):
        load_model(tiny_hf("gpt2"), device_map="auto")
    with pytest.raises(ProbeError, match="nn.Module"):
        load_model(42)  # type: ignore[arg-type]


def test_results_become_dataframes() -> None:
    loaded = tiny_loaded("llama_gqa")
    result = classify(loaded, seq_len=16, num_seqs=2, repeat_len=8)
    frame = result.to_frame()
    assert len(frame) == 2 * 4 and list(frame.columns[:2]) == ["layer", "head"]
    row = frame[(frame["layer"] == 1) & (frame["head"] == 2)].iloc[0]
    assert row["induction"] == pytest.approx(float(result.scores["induction"][1, 2]))
    assert row["labels"] == ",".join(result.labels(1, 2))

    probe_set = repeated_set(loaded, repeat_len=8, num_seqs=2)
    swept = sweep(loaded, probe_set, [(0, 1), (1, 3)])
    frame = swept.to_frame()
    assert list(frame["name"]) == ["L0H1", "L1H3"] or list(frame["name"]) == ["L1H3", "L0H1"]
    assert frame.set_index("name")["delta"].to_dict() == {f"L{r.layer}H{r.head}": r.delta for r in swept.results}
    assert set(estimate(loaded, probe_set).to_frame()["value"]) == {"exact", "estimated"}


def test_to_frame_without_pandas_says_how_to_get_it(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pandas", None)  # as if it were not installed
    result = classify(tiny_loaded("llama_gqa"), seq_len=16, num_seqs=2, repeat_len=8)
    with pytest.raises(ProbeError, match=r"needs pandas, an optional extra: pip install 'probe-heads\[dataframe\]'"):
        result.to_frame()


def test_progress_true_draws_a_bar_and_the_library_logs(capsys, caplog, monkeypatch) -> None:
    import probe.progress

    monkeypatch.setattr(probe.progress, "MIN_GAP", 0.0)  # off a terminal, every stage's end is said however short
    loaded = tiny_loaded("llama_gqa")
    with caplog.at_level("INFO", logger="probe"):
        classify(loaded, seq_len=16, num_seqs=2, repeat_len=8, progress=True)
        sweep(loaded, repeated_set(loaded, repeat_len=8, num_seqs=2), [(0, 1)], progress=True)
    err = capsys.readouterr().err
    assert re.search(r"^classifying heads.*100%", err, re.M) and re.search(r"^ablating heads.*100%", err, re.M), err
    messages = [record.getMessage() for record in caplog.records if record.name.startswith("probe")]
    assert any(m.startswith("classified ") for m in messages) and any(m.startswith("sweep of 1 ablations") for m in
                                                                     messages)
    seen: list[tuple[int, int]] = []
    classify(loaded, seq_len=16, num_seqs=2, repeat_len=8, progress=lambda done, total: seen.append((done, total)))
    assert seen and seen[-1][0] == seen[-1][1]

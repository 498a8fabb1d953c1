"""What a newcomer meets on a laptop: loading a model from Python prints nothing of transformers' own ("Loading
weights" bars) and leaves transformers' progress-bar setting as it found it; getting-started names bfloat16."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import tiny_hf
from transformers.utils import logging as hf_logging

from probe.models import load_model


def test_the_python_api_prints_no_loading_bar(tmp_path: Path, capfd) -> None:
    tiny_hf("llama_gqa").save_pretrained(tmp_path / "tiny")
    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()  # as in a fresh Python session (the CLI turns them off for good)
    try:
        capfd.readouterr()
        loaded = load_model(str(tmp_path / "tiny"))
        err = capfd.readouterr().err
        assert loaded.model is not None and "Loading weights" not in err and "it/s]" not in err, err
        assert hf_logging.is_progress_bar_enabled()  # the user's setting, as it was
    finally:
        (hf_logging.enable_progress_bar if was_on else hf_logging.disable_progress_bar)()


def test_getting_started_names_bfloat16() -> None:
    """A newcomer on a laptop learns that every command runs in bfloat16 too (half the memory)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "getting-started.md").read_text(encoding="utf-8")
    assert "--dtype bfloat16" in text


@pytest.mark.slow  # dequantises SmolLM2's GGUF file afresh (the fixture would load it from the cache)
def test_a_gguf_load_says_whether_it_dequantises_and_draws_no_bar_of_transformers(tmp_path: Path, capfd,
                                                                                   monkeypatch) -> None:
    """The first load of a GGUF file dequantises it (said, without transformers' own tqdm bar), a later one reads
    probe's cache (said so); tqdm draws bars again afterwards."""
    from tqdm import tqdm

    from probe.models.load import loading_words

    monkeypatch.setenv("PROBE_CACHE", str(tmp_path))  # an empty cache: the first run's dequantising
    assert loading_words("smollm2") == "loading smollm2 (dequantising its GGUF file, once: later runs read the cache)"
    capfd.readouterr()
    assert load_model("smollm2").model is not None
    err = capfd.readouterr().err
    assert "de-quantizing" not in err and "it/s]" not in err, err
    assert loading_words("smollm2") == "loading smollm2 from its dequantised cache"
    assert loading_words("no/such/model") == "loading no/such/model"
    for _ in tqdm(range(2), desc="after"):
        pass
    assert "after" in capfd.readouterr().err  # tqdm's bars as they were

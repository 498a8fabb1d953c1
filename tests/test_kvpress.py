"""probe's DuoAttention export read by NVIDIA's kvpress: `kvpress_pattern` returns what kvpress's
`DuoAttentionPress.load_attention_pattern` returns, and the round trip (probe kv-heads --export duo:DIR ->
DuoAttentionPress -> kvpress's pipeline generating on SmolLM2) streams exactly the map's heads. The round trip runs
where kvpress is installed (.ci/run makes that environment) and is skipped elsewhere."""

from __future__ import annotations

import json
import subprocess
import sys
from io import StringIO
from pathlib import Path

import numpy as np
import pytest
import torch

from probe.errors import ProbeError
from probe.headmaps import KV, HeadMap, kvpress_head_ratio, kvpress_pattern, write_map

NEEDLE = "The pass key is 71432. Remember it. 71432 is the pass key. "
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def _export(folder: Path, values: np.ndarray, sink: int = 4, recent: int = 8) -> Path:
    head_map = HeadMap(values, KV, "test", "duo", "full_attention", n_kv_heads=values.shape[1], threshold=0.5)
    return write_map(head_map, folder, "duo", settings={"sink_size": sink, "recent_size": recent})


def test_pattern_is_what_kvpress_reads(tmp_path: Path) -> None:
    values = np.array([[0.1, 0.9, 0.5], [0.7, 0.25, 1.0]])
    folder = _export(tmp_path / "duo", values)
    sink, recent, scores = kvpress_pattern(folder)
    # kvpress 0.5.5's load_attention_pattern: config.json's sizes, np.loadtxt of the TSV, clipped to [0, 1]
    text = (folder / "full_attention_heads.tsv").read_text()
    expected = np.clip(np.loadtxt(StringIO(text), dtype=float, delimiter="\t"), 0, 1)
    config = json.loads((folder / "config.json").read_text())
    assert (sink, recent) == (config["sink_size"], config["recent_size"]) == (4, 8)
    assert scores.dtype == expected.dtype == np.float64 and np.array_equal(scores, expected)
    assert kvpress_head_ratio(folder) == 3 / 6  # 0.1, 0.5 and 0.25 stream (at or below the threshold)


def test_pattern_checks_the_model_and_the_folder(tmp_path: Path) -> None:
    folder = _export(tmp_path / "duo", np.full((2, 3), 0.75))
    model = type("M", (), {"config": type("C", (), {"num_hidden_layers": 2, "num_key_value_heads": 4,
                                                    "num_attention_heads": 8})()})()
    with pytest.raises(ProbeError, match="2 layers x 3 KV heads; the model has 2 x 4"):
        kvpress_pattern(folder, model)
    (folder / "config.json").write_text(json.dumps({"threshold": 0.5}))
    with pytest.raises(ProbeError, match="no integer sink_size, recent_size"):
        kvpress_pattern(folder)
    with pytest.raises(ProbeError, match="does not exist"):
        kvpress_pattern(tmp_path / "nothing")


def _answer(pipe, press) -> str:
    context = FILLER * 20 + NEEDLE + FILLER * 20
    return pipe(context, question="What is the pass key?", answer_prefix="The pass key is", press=press,
                max_new_tokens=8)["answer"], context


def test_round_trip_through_kvpress(smollm2, tmp_path: Path) -> None:
    kvpress = pytest.importorskip("kvpress", reason="kvpress is not installed here (.ci/run makes its own venv)")
    from transformers import pipeline

    folder = tmp_path / "duo"
    subprocess.run([sys.executable, "-m", "probe.cli", "-q", "kv-heads", "--lengths", "512", "--depths", "0.5",
                    "--full-fraction", "0.5", "--no-curve", "--export", f"duo:{folder}"],
                   check=True, stdout=subprocess.DEVNULL)
    sink, recent, scores = kvpress_pattern(folder, smollm2.model)
    ratio = kvpress_head_ratio(folder)
    assert ratio == 0.5

    tokenizer = smollm2.tokenizer
    template, tokenizer.chat_template = tokenizer.chat_template, None  # a plain prompt (docs/kv-heads.md)
    try:
        pipe = pipeline("kv-press-text-generation", model=smollm2.model, tokenizer=tokenizer)
        press = kvpress.DuoAttentionPress(head_compression_ratio=ratio)
        press.load_attention_pattern = lambda model: kvpress_pattern(folder, model)
        answer, context = _answer(pipe, press)
        streamed_all = kvpress.DuoAttentionPress(head_compression_ratio=1.0)
        streamed_all.load_attention_pattern = press.load_attention_pattern
        lost, _ = _answer(pipe, streamed_all)
    finally:
        tokenizer.chat_template = template
    assert "71432" in answer  # the map's full heads keep the needle in the middle of the context
    assert "71432" not in lost  # with every head streamed the needle is outside sink + recent: the press is applied
    assert torch.equal(press.streaming_mask.cpu(), torch.from_numpy(scores <= 0.5))  # exactly the map's heads
    length = len(tokenizer.encode(tokenizer.bos_token + context, add_special_tokens=False))  # as the pipeline does
    implied = ratio * (1 - (sink + recent) / length)
    print(f"kvpress compression ratio {press.compression_ratio:.6f}; the map implies {implied:.6f} "
          f"({ratio:g} of the KV heads streamed, sink {sink} + recent {recent} of {length} tokens)")
    assert press.compression_ratio == pytest.approx(implied, rel=1e-9)

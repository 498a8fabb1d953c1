"""`probe kv-heads --kvpress-ratio`: the budget for kvpress's DuoAttentionPress removing a fraction of the KV cache.
The export streams exactly the KV heads the press streams for the head_compression_ratio printed (kvpress 0.5.5's
selection, `np.argsort(head_scores, axis=None)[:round(n * ratio)]`, done here as it does it), and a ratio the press
cannot reach is one line before any model loads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli

from probe.headmaps import kvpress_head_ratio, kvpress_pattern
from probe.headmaps.kvpress import kvpress_removable, kvpress_streamed

TESTS = Path(__file__).parent
PLANTED_HF = f"{TESTS / 'planted.py'}:planted_gpt2"  # 2 layers x 4 KV heads, one retrieval head (1.1)


def kvpress_streams(scores: np.ndarray, head_compression_ratio: float) -> set[tuple[int, int]]:
    """The KV heads kvpress 0.5.5's DuoAttentionPress.post_init_from_model streams."""
    pruned = round(scores.size * head_compression_ratio)
    indices = np.argsort(scores, axis=None)[:pruned]
    return {(int(layer), int(kv)) for layer, kv in zip(*np.unravel_index(indices, scores.shape))}


def test_the_export_streams_exactly_what_kvpress_streams_for_the_ratio(tmp_path: Path, capsys, monkeypatch) -> None:
    folder, out = tmp_path / "duo", tmp_path / "kv.json"
    code, stdout, err = run_cli(["kv-heads", "--model", PLANTED_HF, "--lengths", "250", "--depths", "0.5", "--sink",
                                 "1", "--recent", "4", "--no-curve", "--curve-texts", "1", "--kvpress-ratio", "0.5",
                                 "--export", f"duo:{folder}", "--json", str(out)], capsys, monkeypatch)
    assert code == 0, err
    # 0.5 of a 250-token cache: each streamed head keeps 1 + 4 keys, so 0.5 / (1 - 5 / 250) of the 8 heads, 4
    assert "DuoAttentionPress(head_compression_ratio=0.5)" in " ".join(stdout.split())
    config = json.loads((folder / "config.json").read_text())
    assert config["head_compression_ratio"] == 0.5 == kvpress_head_ratio(folder)
    record = json.loads((folder / "probe_budget.json").read_text())
    assert record["budget"]["kvpress"] == {"compression_ratio": 0.5, "head_compression_ratio": 0.5, "length": 250,
                                           "removed": 0.49, "sink_size": 1, "recent_size": 4}
    streaming = {tuple(head) for head in record["streaming"]}
    _, _, scores = kvpress_pattern(folder)
    assert kvpress_streams(scores, config["head_compression_ratio"]) == streaming and len(streaming) == 4
    payload = json.loads(out.read_text())
    assert {(row["layer"], row["kv_head"]) for row in payload["kv_heads"] if row["label"] == "streaming"} == streaming
    assert (1, 1) not in streaming  # the planted retrieval head stays full
    (point,) = record["budget"]["points"]  # the point of the ratio, measured on held-out prompts and texts
    assert point["k"] == 4 and 0.0 <= point["needle_accuracy"] <= 1.0
    assert record["budget"]["measured_on"]["needle_seed"] == 2000


@pytest.mark.parametrize("n", [8, 34, 90, 448])
def test_kvpress_streams_the_count_the_ratio_asks_for_every_ratio(n: int) -> None:
    """Every ratio the press can reach: the head_compression_ratio makes kvpress stream exactly k heads, the k whose
    removed fraction is nearest the ratio."""
    for ratio in np.linspace(0.01, 0.68, 67):
        k, head_ratio = kvpress_streamed(float(ratio), n, 64, 256, 1024)
        assert round(n * head_ratio) == k  # kvpress's own rounding
        share = kvpress_removable(64, 256, 1024) / n  # what one streamed head removes
        assert abs(k * share - ratio) <= share / 2 + 1e-12


@pytest.mark.parametrize("args, expected", [
    (["--kvpress-ratio", "1.5"], "--kvpress-ratio is the fraction of the KV cache kvpress removes, in (0, 1)"),
    (["--kvpress-ratio", "0"], "in (0, 1); got 0"),
    (["--kvpress-ratio", "nan"], "in (0, 1); got nan"),
    (["--kvpress-ratio", "0.99"], "streaming every KV head removes 0.9800 of a 250-token cache"),
    (["--kvpress-ratio", "0.5", "--full-fraction", "0.25"], "--kvpress-ratio is a budget of its own: give no full"),
])
def test_a_ratio_kvpress_cannot_reach_is_one_line_before_the_model_loads(args: list[str], expected: str, capsys,
                                                                         monkeypatch) -> None:
    def never(*_args, **_kwargs):
        raise AssertionError("the model loaded before the arguments were checked")

    monkeypatch.setattr("probe.cli.kv_heads.load", never)
    code, _, err = run_cli(["kv-heads", "--model", PLANTED_HF, "--lengths", "250", "--sink", "1", "--recent", "4",
                            *args], capsys, monkeypatch)
    assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, err

"""HTML reports without a browser: patterns computed right, pages self-contained, escaped and compact."""

from __future__ import annotations

import base64
import json
import re
import zlib

import numpy as np
import pytest
import torch

from conftest import run_cli, tiny_loaded
from probe.hooks.capture import capture_attention
from probe.heads.classify import Classification
from probe.inputs import natural_set, repeated_set
from probe.errors import ProbeError
from probe.patterns import (AVERAGE, Patterns, attention_patterns, classification_patterns, text_ids, text_patterns,
                            token_strings, visible)
from probe.reports.html import (ablation_page, classification_page, esc, heatmap_page, pack_uint16, pattern_spec,
                                plotly_text, script_json)

SCRIPT = "<script>alert(1)</script>"
IMG = '"><img src=x onerror=alert(1)>'


def unpack_uint16(text: str) -> np.ndarray:
    """What the page's runtime does: base64 -> inflate -> byte planes -> uint16."""
    planes = np.frombuffer(zlib.decompress(base64.b64decode(text)), dtype=np.uint8)
    half = len(planes) // 2
    return (planes[:half].astype(np.uint16) | (planes[half:].astype(np.uint16) << 8))


def page_data(page: str) -> dict:
    match = re.search(r'<script type="application/json" id="[^"]+-data">(.*?)</script>', page, re.S)
    assert match
    return json.loads(match.group(1))


def fake_patterns(tokens: list[str], *, causal: bool = True, model: str = "m", source: str = "s") -> Patterns:
    """Patterns made by hand: reports must draw whatever they are given."""
    n, heads = len(tokens), [(0, 0), (0, 1), (0, AVERAGE), (1, 0), (1, 1), (1, AVERAGE)]
    generator = torch.Generator().manual_seed(0)
    weights = torch.rand(len(heads), n, n, generator=generator)
    if causal:
        weights = weights.tril()
    weights = weights / weights.sum(-1, keepdim=True)
    values = (weights * 1000).round().to(torch.int32).numpy().astype(np.uint16)
    thumbs = (weights * 255).round().to(torch.uint8).numpy()
    return Patterns(model=model, source=source, tokens=tokens, heads=heads, values=values, decimals=3,
                    causal=causal, n_layers=2, n_heads=2, total_tokens=n, thumbnails=thumbs)


# ---------------------------------------------------------------------------------------------------------------
# token strings


def test_visible_marks_whitespace_and_invisible_characters():
    assert visible(" the") == "␣the"
    assert visible("\n\n") == "↵↵"
    assert visible("\t") == "⇥"
    assert visible("\r\n") == "␍↵"
    assert visible("a\x07b") == "a\\x07b"
    assert visible("\u200b") == "\\u200b"
    assert visible("\u00a0") == "\\xa0"
    assert visible("") == "∅"
    assert visible("café") == "café"
    assert visible(SCRIPT) == SCRIPT  # escaping is the page's job, not the label's


def test_token_strings_without_tokenizer():
    loaded = tiny_loaded("llama_gqa")
    assert token_strings(loaded, [3, 4, 3]) == ["#3", "#4", "#3"]
    with pytest.raises(ProbeError, match="no tokenizer"):
        text_ids(loaded, "hello")


def test_token_strings_of_a_real_tokenizer(smollm2):
    ids = text_ids(smollm2, "Hi  there\n\tcafé 😀 the the")
    strings = token_strings(smollm2, ids)
    assert strings[0] == "⟨<|im_start|>⟩"  # BOS, a special token
    assert "↵" in strings and "⇥" in strings
    assert any(s.startswith("␣") for s in strings)
    assert any("\\xf0\\x9f" in s for s in strings), strings  # part of the emoji's bytes, shown as bytes
    assert strings.count("␣the") == 2
    labels = fake_patterns(strings).labels
    assert len(set(labels)) == len(labels)  # repeated tokens stay distinct
    assert labels[0] == "0:⟨<|im_start|>⟩"


# ---------------------------------------------------------------------------------------------------------------
# patterns


def test_attention_patterns_equal_captured_attention():
    loaded = tiny_loaded("llama_gqa")
    ids = torch.tensor([1, 5, 7, 9, 5, 7, 9, 11, 2, 3])
    patterns = attention_patterns(loaded, ids, source="test")
    captured = capture_attention(loaded.model, ids[None])
    assert patterns.causal
    assert patterns.heads == [(layer, head) for layer in range(2) for head in (0, 1, 2, 3, AVERAGE)]
    assert patterns.values.dtype == np.uint16 and patterns.values.shape == (10, 10, 10)
    assert patterns.thumbnails is not None and patterns.thumbnails.shape == (10, 10, 10)
    for layer in range(2):
        for head in range(4):
            expected = captured[layer][0, head].numpy()
            got = patterns.weights(layer, head)
            assert np.isnan(got[np.triu_indices(10, 1)]).all()
            lower = np.tril_indices(10)
            np.testing.assert_allclose(got[lower], expected[lower], atol=5e-4 + 1e-7)
        mean = captured[layer][0].mean(0).numpy()
        np.testing.assert_allclose(patterns.weights(layer, AVERAGE)[np.tril_indices(10)],
                                   mean[np.tril_indices(10)], atol=5e-4 + 1e-7)


def test_bidirectional_models_are_not_masked():
    loaded = tiny_loaded("bert")
    patterns = attention_patterns(loaded, torch.arange(1, 9), source="test", decimals=4)
    assert not patterns.causal
    assert not np.isnan(patterns.weights(0, 0)).any()
    spec = pattern_spec(patterns.page_payload(), 5)
    assert len(unpack_uint16(spec["chunks"][0])) == 5 * 8 * 8


def test_long_inputs_are_cut_with_a_note_and_bad_options_refused():
    loaded = tiny_loaded("llama_gqa")
    patterns = attention_patterns(loaded, torch.arange(1, 101), source="test", max_tokens=40, layers={1})
    assert len(patterns.tokens) == 40 and patterns.total_tokens == 100
    assert "first 40" in patterns.note and "100 tokens" in patterns.note
    assert {layer for layer, _ in patterns.heads} == {1}
    assert patterns.thumbnails is not None and patterns.thumbnails.shape[-1] == 20  # max-pooled by 2
    with pytest.raises(ProbeError, match="max_tokens"):
        attention_patterns(loaded, torch.arange(5), source="t", max_tokens=5000)
    with pytest.raises(ProbeError, match="decimals"):
        attention_patterns(loaded, torch.arange(5), source="t", decimals=6)
    with pytest.raises(ProbeError, match="layer 7 does not exist"):
        attention_patterns(loaded, torch.arange(5), source="t", layers={7})
    with pytest.raises(ProbeError, match="head 9 does not exist"):
        attention_patterns(loaded, torch.arange(5), source="t", heads=[(0, 9)])


def test_a_window_of_a_long_input_is_its_part_of_the_full_attention():
    """A window shows the attention among its positions as computed on the whole context before it, and says how
    much of its queries' attention goes to keys outside it."""
    loaded = tiny_loaded("llama_gqa")
    ids = torch.randint(1, 120, (100,), generator=torch.Generator().manual_seed(0))
    captured = capture_attention(loaded.model, ids[None])
    patterns = attention_patterns(loaded, ids, source="test", max_tokens=30, start=50)
    assert len(patterns.tokens) == 30 and patterns.total_tokens == 100 and patterns.first == 50
    assert patterns.labels[0].startswith("50:") and patterns.labels[-1].startswith("79:")
    assert "positions 50 to 79" in patterns.note and "first 80" in patterns.note
    inside, total = 0.0, 0
    for layer in range(2):
        for head in range(4):
            expected = captured[layer][0, head, 50:80, 50:80].numpy()
            lower = np.tril_indices(30)
            np.testing.assert_allclose(patterns.weights(layer, head)[lower], expected[lower], atol=5e-4 + 1e-7)
            inside += float(captured[layer][0, head, 50:80, 50:80].sum())
            total += 30
    assert f"{1 - inside / total:.1%} of these queries' attention" in patterns.note
    bert = tiny_loaded("bert")  # bidirectional: the window's queries see keys after it too, so all tokens run
    window = attention_patterns(bert, ids[:60], source="t", max_tokens=20, start=40, decimals=4)
    np.testing.assert_allclose(window.weights(1, 2), capture_attention(bert.model, ids[None, :60])[1][0, 2, 40:, 40:],
                               atol=5e-5 + 1e-7)
    assert "ran on all of them" in window.note
    with pytest.raises(ProbeError, match="start must be a position"):
        attention_patterns(loaded, ids, source="t", start=100)


def test_classification_patterns_use_the_sequence_that_earned_the_label():
    loaded = tiny_loaded("llama_gqa")
    scores = {name: torch.zeros(2, 4) for name in ("sink", "induction", "previous_token")}
    scores["sink"][0, 1] = 0.9
    scores["induction"][1, 2] = 0.8
    scores["induction"][0, 3] = 0.7
    result = Classification(model="tiny", n_layers=2, n_heads=4, scores=scores,
                            thresholds={"sink": 0.3, "induction": 0.4, "previous_token": 0.5},
                            probe_sets={"natural": {"num_seqs": 3}, "repeated": {"num_seqs": 3}})
    patterns = classification_patterns(loaded, result, seq_len=12, repeat_len=6, seed=1)
    assert set(patterns) == {"natural", "repeated"}
    assert patterns["natural"].heads == [(0, 1)]
    assert patterns["repeated"].heads == [(0, 3), (1, 2)]
    repeated = repeated_set(loaded, repeat_len=6, num_seqs=3, seed=1).input_ids[0]
    natural = natural_set(loaded, seq_len=12, num_seqs=3, seed=1).input_ids[0]
    assert len(patterns["repeated"].tokens) == len(repeated) and len(patterns["natural"].tokens) == len(natural)
    expected = capture_attention(loaded.model, repeated[None], layers={1})[1][0, 2].numpy()
    lower = np.tril_indices(len(repeated))
    np.testing.assert_allclose(patterns["repeated"].weights(1, 2)[lower], expected[lower], atol=5e-4 + 1e-7)
    page = classification_page(result.to_dict(), {name: block.page_payload() for name, block in patterns.items()})
    data = page_data(page)
    assert set(data["patterns"]) == {"natural", "repeated"}
    assert [s["name"] for s in data["scores"]] == ["sink", "induction", "previous_token"]
    assert data["scores"][1]["flagged"] == [[1, 2, 0.8], [0, 3, 0.7]]


# ---------------------------------------------------------------------------------------------------------------
# encoding and escaping


def test_packing_round_trips_and_compresses():
    values = np.zeros((3, 50, 50), dtype=np.uint16)
    values[:, np.arange(50), np.arange(50)] = 1000
    values[0, 3, 1] = 65535
    assert np.array_equal(unpack_uint16(pack_uint16(values)), values.reshape(-1))
    assert len(pack_uint16(values)) < values.nbytes / 20


def test_pattern_spec_keeps_the_lower_triangle_of_causal_models():
    patterns = fake_patterns([f"t{i}" for i in range(7)])
    spec = pattern_spec(patterns.page_payload(), 3)
    assert len(spec["chunks"]) == 2 and spec["group"] == 3 and spec["causal"]
    flat = np.concatenate([unpack_uint16(chunk) for chunk in spec["chunks"]]).reshape(6, -1)
    rows, cols = np.tril_indices(7)
    assert np.array_equal(flat, patterns.values[:, rows, cols])


def test_escaping_helpers():
    assert esc(IMG) == "&quot;&gt;&lt;img src=x onerror=alert(1)&gt;"
    assert plotly_text("a<b>&c") == "a&lt;b&gt;&amp;c"
    text = script_json({"a": SCRIPT + "\u2028<!--"})
    assert "<" not in text and ">" not in text and "\u2028" not in text
    assert json.loads(text) == {"a": SCRIPT + "\u2028<!--"}


def test_heatmap_page_is_self_contained_and_escaped():
    tokens = [SCRIPT, IMG, "␣the", "&amp;", "␣the"]
    page = heatmap_page(fake_patterns(tokens, model=SCRIPT, source=f"text file {IMG}").page_payload())
    assert page.startswith("<!DOCTYPE html>")
    assert "Content-Security-Policy" in page and "default-src &#x27;none&#x27;" in page
    assert "window.Plotly = Plotly" in page  # plotly.js inlined
    assert not re.search(r"<(link|iframe|img|object|embed)\b", page)
    assert not re.search(r"<script[^>]+src=", page)
    assert SCRIPT not in page and "<img" not in page  # nowhere raw, not even inside the JSON
    assert f"Attention of {esc(SCRIPT)}" in page and esc(f"text file {IMG}") in page
    spec = page_data(page)["patterns"]
    assert spec["labels"][0] == "0:&lt;script&gt;alert(1)&lt;/script&gt;"
    assert spec["labels"][3] == "3:&amp;amp;"
    assert spec["labels"][2] != spec["labels"][4]


@pytest.mark.parametrize("name", ["induction", "duplicate_token"])
def test_the_page_marks_the_diagonal_the_class_scores(name: str) -> None:
    """The classify page draws its expected diagonal (key - query + R) where the class's score reads: attention put
    there alone scores 1."""
    from probe.heads.scores import SCORES, Batch

    result = Classification(model="m", n_layers=1, n_heads=1, scores={name: torch.ones(1, 1)}, thresholds={name: 0.4})
    diagonal = next(score["diagonal"] for score in page_data(classification_page(result.to_dict()))["scores"])
    repeat, n = 5, 11  # BOS, R tokens, the same R again
    weights = torch.zeros(1, 1, n, n)
    for query in range(1 + repeat, 1 + 2 * repeat):
        weights[0, 0, query, query - repeat + diagonal] = 1.0
    sums, counts = SCORES[name].reduce(weights, 0, Batch(torch.ones(1, n, dtype=torch.bool), 1, repeat))
    assert torch.equal(sums / counts, torch.ones(1))


def test_notebook_fragments_each_carry_plotly_and_a_static_summary():
    result = Classification(model=SCRIPT, n_layers=3, n_heads=2, scores={"sink": torch.rand(3, 2)},
                            thresholds={"sink": 0.3})
    first, second = (classification_page(result.to_dict(), embed_plotly=False) for _ in range(2))
    for fragment in (first, second):  # each output can draw alone (an iframe of its own), plotly run only if missing
        assert "<html" not in fragment.lower() and "<!doctype" not in fragment.lower() and "<meta" not in fragment
        assert fragment.count("window.Plotly = Plotly") == 1 and "if (window.Plotly) return;" in fragment
        assert '<script type="text/plain" id="' in fragment and "probeReports.start" in fragment
        assert 'class="probe-static"' in fragment
    assert SCRIPT not in first and esc(SCRIPT) in first
    ids = re.findall(r'class="probe-page" id="([^"]+)"', first + second)
    assert len(set(ids)) == 2  # two results in one notebook do not share element ids


def test_plain_text_reprs_are_short_summaries():
    result = Classification(model="m", n_layers=30, n_heads=9, scores={"sink": torch.rand(30, 9)},
                            thresholds={"sink": 0.5})
    text = repr(result)
    assert text.startswith("Classification('m': 30 layers x 9 heads; flagged: sink ") and len(text) < 200
    patterns = fake_patterns(["a", "b", "c"])
    assert repr(patterns) == "Patterns('m': 6 heads of 2x2 on 3 of 3 tokens from s)"


def test_ablation_page_from_a_dict():
    heads = [{"layer": layer, "head": head, "loss": 2.0 + 0.01 * (layer + head), "delta": 0.01 * (layer - head)}
             for layer in range(4) for head in range(3) if (layer, head) != (2, 1)]
    result = {"model": SCRIPT, "method": "zero", "data": IMG, "baseline_loss": 2.0, "heads": heads}
    page = ablation_page(result, top=5)
    data = page_data(page)
    assert (data["n_layers"], data["n_heads"]) == (4, 3)  # derived from the heads
    assert data["z"][2][1] is None and data["z"][3][0] == pytest.approx(0.03)
    assert data["top"]["delta"] == sorted(data["top"]["delta"], key=abs, reverse=True)
    assert len(data["top"]["label"]) == 5 and data["top"]["label"][0] == "3.0"
    assert data["top"]["name"][0] == "layer 3, head 0"
    assert SCRIPT not in page and "<img" not in page
    assert ablation_page(result | {"n_layers": 6, "n_heads": 3}).count("probeReports.start") == 1
    with pytest.raises(ProbeError, match="baseline_loss"):
        ablation_page({"model": "m", "method": "zero", "heads": heads})
    with pytest.raises(ProbeError, match="heads\\[0\\]"):
        ablation_page(result | {"heads": [{"layer": 0}]})
    with pytest.raises(ProbeError, match="outside"):
        ablation_page(result | {"n_layers": 2})
    with pytest.raises(ProbeError, match="must be a number"):
        ablation_page(result | {"heads": [{"layer": 0, "head": 0, "loss": "2.0", "delta": 0.0}]})


def test_ablation_page_leaves_heads_without_a_finite_loss_blank():
    """A NaN (or, read back from strict JSON, null) delta is a blank cell and no bar, not an error."""
    heads = [{"layer": 0, "head": 0, "loss": 2.5, "delta": 0.5}, {"layer": 0, "head": 1, "loss": float("nan"),
             "delta": float("nan")}, {"layer": 1, "head": 0, "loss": None, "delta": None}]
    page = ablation_page({"model": "m", "method": "zero", "baseline_loss": 2.0, "heads": heads})
    data = page_data(page)
    assert data["z"] == [[0.5, None], [None, None]] and data["top"]["label"] == ["0.0"]
    assert "2 with a loss that is not a finite number" in page


# ---------------------------------------------------------------------------------------------------------------
# the command


def test_heatmap_command(smollm2, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("probe.cli.heatmap.load", lambda *args, **kwargs: smollm2)
    out = tmp_path / "page.html"
    code, _, err = run_cli(["heatmap", "--text", f"A cat. {SCRIPT} A cat.", "--html", str(out),
                            "--layers", "0-1,29"], capsys, monkeypatch)
    assert code == 0, err
    data = page_data(out.read_text(encoding="utf-8"))["patterns"]
    assert {layer for layer, _ in data["heads"]} == {0, 1, 29}
    assert data["labels"][0] == "0:⟨&lt;|im_start|&gt;⟩"
    code, _, err = run_cli(["heatmap", "--text", "again", "--html", str(out)], capsys, monkeypatch)
    assert code == 2 and "--force" in err
    code, _, err = run_cli(["heatmap", "--text", "a", "--file", str(out), "--html", str(tmp_path / "x.html")],
                           capsys, monkeypatch)
    assert code == 2 and "exactly one" in err
    code, _, err = run_cli(["heatmap", "--file", str(tmp_path / "missing.txt"), "--html",
                            str(tmp_path / "x.html")], capsys, monkeypatch)
    assert code == 2 and "not found" in err
    code, _, err = run_cli(["heatmap", "--text", "a", "--html", str(tmp_path / "x.html"), "--max-tokens", "5000"],
                           capsys, monkeypatch)
    assert code == 2 and "max-tokens" in err
    code, _, err = run_cli(["heatmap", "--text", "a", "--html", str(tmp_path / "x.html"), "--layers", "3-1"],
                           capsys, monkeypatch)
    assert code == 2 and "--layers" in err
    assert not (tmp_path / "x.html").exists()


def test_text_patterns_cut_long_text(smollm2, monkeypatch):
    patterns = text_patterns(smollm2, "word " * 299 + "word", source="t", max_tokens=64, layers={0})
    assert len(patterns.tokens) == 64 and patterns.total_tokens == 301 and "first 64" in patterns.note
    monkeypatch.setattr("probe.patterns.LARGE_TEXT", 1000)
    patterns = text_patterns(smollm2, "word " * 3000, source="t", max_tokens=64, layers={0})
    assert len(patterns.tokens) == 64 and "15,000 characters" in patterns.note
    assert patterns.tokens[1:] == ["word"] + ["␣word"] * 62
    window = text_patterns(smollm2, "word " * 3000, source="t", max_tokens=64, layers={0}, start=1000)
    assert window.labels[0] == "1000:␣word" and "positions 1,000 to 1,063" in window.note


def test_heatmap_window_from_the_command_line(smollm2, tmp_path, capsys, monkeypatch):
    page = tmp_path / "window.html"
    code, out, err = run_cli(["heatmap", "--text", "word " * 400, "--html", str(page), "--layers", "0",
                              "--max-tokens", "32", "--window-start", "300"], capsys, monkeypatch)
    assert code == 0, err
    assert "positions 300 to 331" in out + err and "300:␣word" in page.read_text(encoding="utf-8")
    code, _, err = run_cli(["heatmap", "--text", "word " * 10, "--html", str(tmp_path / "bad.html"),
                            "--window-start", "50"], capsys, monkeypatch)
    assert code == 2 and "--window-start must be a position of the input, 0 to 11; got 50" in err  # BOS + 11
    assert not (tmp_path / "bad.html").exists()

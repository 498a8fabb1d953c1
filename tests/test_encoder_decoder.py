"""Encoder-decoders (T5, BART) as three named stacks: encoder, decoder self-attention and cross-attention. Captured
attention equals the model's own eager encoder_attentions / decoder_attentions / cross_attentions; ablation equals a
pre-hook zeroing the head's slice of that stack's output projection (named by hand in tests/families.py); the loss
is the model's own `labels` loss, also for source/target pairs; the model is unchanged afterwards. Whisper (audio),
other encoder-decoders, and the commands that read one stack are refused in one line."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from conftest import run_cli, tiny_loaded
from families import ENCODER_DECODER_PROJECTIONS, pre_hooks, tiny_encoder_decoder, zero_head_slices
from test_browser import browser, open_page, tick_texts  # noqa: F401 (fixtures)
from test_families import assert_unchanged, eager, snapshot
from test_html import page_data

from probe.ablation import ablate, parse_heads, sweep
from probe.hooks.capture import capture_attention
from probe.hooks.layers import attention_layers
from probe.hooks.run import logits_of, run_model
from probe.hooks.stacks import layer_names
from probe.inputs import ProbeOptions, ProbeSet, build_probe_set
from probe.errors import ProbeError
from probe.models import LoadedModel, load_model

SUPPORTED = ["t5", "bart"]
STACK_OUTPUTS = {"encoder": "encoder_attentions", "decoder": "decoder_attentions", "cross": "cross_attentions"}


def padded_batch(length: int = 13, low: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.randint(low, 120, (3, length))
    mask = torch.ones_like(ids)
    mask[1, length - 4:] = 0
    mask[2, 4:] = 0
    return ids, mask


@pytest.mark.parametrize("name", SUPPORTED)
def test_layers_are_three_named_stacks_in_call_order(name: str) -> None:
    model = tiny_encoder_decoder(name)
    layers = attention_layers(model)
    assert [(layer.stack, layer.in_stack) for layer in layers] == [
        ("encoder", 0), ("encoder", 1), ("decoder", 0), ("cross", 0), ("decoder", 1), ("cross", 1)]
    assert layer_names(layers) == ["enc0", "enc1", "dec0", "x0", "dec1", "x1"]
    assert parse_heads("x1.2,enc0.3,dec0-1.0", layers) == [(5, 2), (0, 3), (2, 0), (4, 0)]
    assert parse_heads("X0", layers) == [(3, h) for h in range(4)]
    with pytest.raises(ProbeError, match="names its layers by stack .*x3.1"):
        parse_heads("1.2", layers)
    with pytest.raises(ProbeError, match="layer 2 .* out of range"):
        parse_heads("x2.0", layers)


def test_a_model_of_one_stack_keeps_plain_numbers(tiny_llama: LoadedModel) -> None:
    layers = attention_layers(tiny_llama.model)
    assert layer_names(layers) is None and parse_heads("1.2", layers) == [(1, 2)]
    with pytest.raises(ProbeError, match="one stack of layers"):
        parse_heads("x1.2", layers)


@pytest.mark.parametrize("name", SUPPORTED)
@pytest.mark.parametrize("padded", [False, True])
def test_capture_of_every_stack_equals_eager_output_attentions(name: str, padded: bool) -> None:
    model = tiny_encoder_decoder(name)
    ids, mask = padded_batch()
    mask = mask if padded else torch.ones_like(ids)
    with eager(model), torch.no_grad():
        output = model(input_ids=ids, attention_mask=mask, decoder_input_ids=ids, decoder_attention_mask=mask,
                       output_attentions=True)
    before = snapshot(model)
    patterns = capture_attention(model, ids, mask if padded else None, query_block=4)
    assert_unchanged(model, before)
    rows = mask.bool()[:, None, :, None]  # padded query rows are no token's attention
    for layer in attention_layers(model):
        reference = getattr(output, STACK_OUTPUTS[layer.stack])[layer.in_stack]
        assert patterns[layer.index].shape == reference.shape == (3, 4, 13, 13)
        assert (patterns[layer.index] - reference).abs().masked_select(rows).max() <= 1e-5, (name, layer.stack)
    decoder = patterns[2]
    assert decoder.triu(1).abs().max() == 0 and patterns[0].triu(1).abs().max() > 0.01  # causal / bidirectional


@pytest.mark.parametrize("name", SUPPORTED)
def test_a_source_of_its_own_length_feeds_the_encoder(name: str, tiny_llama: LoadedModel) -> None:
    model = tiny_encoder_decoder(name)
    target, target_mask = padded_batch(9)
    source, source_mask = padded_batch(15, low=5)
    with eager(model), torch.no_grad():
        output = model(input_ids=source, attention_mask=source_mask, decoder_input_ids=target,
                       decoder_attention_mask=target_mask, output_attentions=True)
    patterns = capture_attention(model, target, target_mask, source=(source, source_mask))
    rows = target_mask.bool()[:, None, :, None]
    for layer in attention_layers(model):
        reference = getattr(output, STACK_OUTPUTS[layer.stack])[layer.in_stack]
        assert patterns[layer.index].shape == reference.shape
        assert (patterns[layer.index] - reference).abs().masked_select(
            rows if layer.stack != "encoder" else source_mask.bool()[:, None, :, None]).max() <= 1e-5
    assert patterns[3].shape == (3, 4, 9, 15)  # cross: decoder queries x encoder keys
    with pytest.raises(ProbeError, match="for encoder-decoders"):
        run_model(tiny_llama.model, target, source=(source, None))


@contextmanager
def projection_input_zeroed(model: torch.nn.Module, name: str, heads: list[tuple[str, int, int]], head_dim: int):
    """The reference ablation: a pre-hook zeroing head h's slice of the input of the stack's layer-i projection."""
    hooks = []
    for stack, index, head in heads:
        projection = model.get_submodule(ENCODER_DECODER_PROJECTIONS[name][stack].format(index))
        hooks.append((projection, lambda _module, args, head=head: zero_head_slices(args, [head], head_dim)))
    with pre_hooks(hooks):
        yield


@pytest.mark.parametrize("name", SUPPORTED)
@pytest.mark.parametrize("stack", ["encoder", "decoder", "cross"])
def test_ablation_in_every_stack_equals_zeroed_projection_input(name: str, stack: str) -> None:
    model = tiny_encoder_decoder(name)
    layers = attention_layers(model)
    ids, mask = padded_batch(11)
    short = {"encoder": "enc", "decoder": "dec", "cross": "x"}[stack]
    heads = parse_heads(f"{short}0.1,{short}1.3", layers)
    with torch.no_grad():
        baseline = logits_of(run_model(model, ids, mask))
        with projection_input_zeroed(model, name, [(stack, 0, 1), (stack, 1, 3)], layers[0].head_dim):
            reference = logits_of(run_model(model, ids, mask))
    before = snapshot(model)
    with torch.no_grad(), ablate(model, heads):
        ablated = logits_of(run_model(model, ids, mask))
    assert_unchanged(model, before)
    real = mask.bool()
    assert (reference - baseline).abs()[real].max() > 1e-3  # the reference does change the output
    assert (ablated - reference).abs()[real].max() <= 1e-5
    with pytest.raises(RuntimeError, match="body failed"), torch.no_grad(), ablate(model, heads):
        run_model(model, ids, mask)
        raise RuntimeError("body failed")
    assert_unchanged(model, before)
    with torch.no_grad():
        assert torch.equal(logits_of(run_model(model, ids, mask)), baseline)


@pytest.mark.parametrize("name", SUPPORTED)
def test_the_loss_is_the_models_labels_loss_and_exact_equals_naive(name: str) -> None:
    model = tiny_encoder_decoder(name)
    loaded = LoadedModel(model=model, tokenizer=None, name=name, vocab_size=120)
    probe_set = build_probe_set("natural", loaded, ProbeOptions(seq_len=8, num_seqs=3))
    ids = probe_set.input_ids
    assert (ids[:, 0] == model.config.decoder_start_token_id).all() and probe_set.offset == 1
    with torch.no_grad():  # the model's own loss: labels shifted right behind the start token are the decoder input
        expected = float(model(input_ids=ids, labels=ids[:, 1:].contiguous()).loss)
    before = snapshot(model)
    heads = parse_heads("enc1.0,dec0.2,x1.3", attention_layers(model))
    naive = sweep(loaded, probe_set, heads, mode="naive", batch_size=2)
    exact = sweep(loaded, probe_set, heads, mode="exact", batch_size=2)
    assert_unchanged(model, before)
    assert naive.baseline_loss == pytest.approx(expected, abs=1e-5)
    assert "encoder-decoder" in exact.path
    for a, b in zip(exact.results, naive.results):
        assert a.heads == b.heads and a.delta == pytest.approx(b.delta, abs=1e-5)
    with torch.no_grad(), projection_input_zeroed(model, name, [("cross", 1, 3)], attention_layers(model)[0].head_dim):
        zeroed = float(model(input_ids=ids, labels=ids[:, 1:].contiguous()).loss)
    assert naive.results[2].loss == pytest.approx(zeroed, abs=1e-5)
    window = sweep(loaded, probe_set, parse_heads("dec1.0", attention_layers(model)), method="window", mode="naive")
    assert len(window.results) == 1  # a decoding cache's window: decoder self-attention only
    with pytest.raises(ProbeError, match="not to its cross layers"):
        sweep(loaded, probe_set, heads[2:], method="window", mode="naive")
    assert_unchanged(model, before)
    payload = naive.to_dict()
    assert payload["layer_names"] == ["enc0", "enc1", "dec0", "x0", "dec1", "x1"]
    assert [row["name"] for row in naive.csv_rows()] != [] and "x1.3" in {r["name"] for r in naive.csv_rows()}


@pytest.mark.parametrize("name", SUPPORTED)
def test_classify_and_ablate_on_a_saved_folder(name: str, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path / "cache"))
    tiny_encoder_decoder(name).save_pretrained(tmp_path / "model")
    folder = str(tmp_path / "model")
    code, out, err = run_cli(["classify", "--model", folder, "--seq-len", "12", "--num-seqs", "2", "--repeat-len", "8",
                              "--json", str(tmp_path / "classes.json")], capsys, monkeypatch)
    assert code == 0, err
    payload = json.loads((tmp_path / "classes.json").read_text(encoding="utf-8"))
    assert payload["layer_names"] == ["enc0", "enc1", "dec0", "x0", "dec1", "x1"] and payload["n_layers"] == 6
    cross = [entry for entry in payload["heads"] if entry["layer"] == 3]
    assert cross and all(entry["scores"]["previous_token"] is None for entry in cross)  # n/a on cross-attention
    assert all(isinstance(entry["scores"]["previous_token"], float)
               for entry in payload["heads"] if entry["layer"] == 2)
    assert "x0" in out and "enc1" in out
    code, out, err = run_cli(["ablate", "--model", folder, "--heads", "x1.2,enc0.1", "--seq-len", "12",
                              "--num-seqs", "2", "--json", str(tmp_path / "ablate.json")], capsys, monkeypatch)
    assert code == 0, err
    result = json.loads((tmp_path / "ablate.json").read_text(encoding="utf-8"))
    assert [(entry["layer"], entry["head"]) for entry in result["heads"]] == [(5, 2), (0, 1)]
    assert result["layer_names"][5] == "x1" and "x1.2" in out
    code, out, err = run_cli(["ablate", "--model", folder, "--heads", "1.2", "--seq-len", "12"], capsys, monkeypatch)
    errors = [line for line in err.splitlines() if not line.startswith("warning:")]
    assert code == 2 and len(errors) == 1
    assert "--heads '1.2': this encoder-decoder names its layers by stack" in errors[0]


def test_whisper_and_other_encoder_decoders_are_refused_in_one_line(tmp_path: Path) -> None:
    import transformers as tf

    from probe.circuits import all_layer_weights

    from probe.kv import kv_heads
    from probe.syntax.run import syntax_scores

    t5 = tiny_encoder_decoder("t5")
    with pytest.raises(ProbeError, match="one residual stream.*circuits does not apply"):
        all_layer_weights(t5)
    with pytest.raises(ProbeError, match="^kv-heads sorts a decoder-only model's KV heads.*not supported$"):
        kv_heads(LoadedModel(model=t5, tokenizer=None, name="t5", vocab_size=120))
    with pytest.raises(ProbeError, match="^probe syntax scores one stack .* not supported yet$"):
        syntax_scores(LoadedModel(model=t5, tokenizer=None, name="t5", vocab_size=120), [], scheme="ud",
                      source="none")

    model = tiny_encoder_decoder("whisper")
    with pytest.raises(ProbeError, match="^whisper is an encoder-decoder whose encoder reads audio.*not supported$"):
        attention_layers(model)
    model.save_pretrained(tmp_path / "whisper")  # refused before the weights load (not as a decoder alone)
    with pytest.raises(ProbeError, match="^whisper is an encoder-decoder") as raised:
        load_model(str(tmp_path / "whisper"))
    assert "\n" not in str(raised.value)
    mbart = tf.MBartForConditionalGeneration(tf.MBartConfig(
        vocab_size=120, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32)).eval()
    with pytest.raises(ProbeError, match="^mbart is an encoder-decoder that probe does not read yet .*t5, bart"):
        attention_layers(mbart)


@pytest.mark.slow
@pytest.mark.browser
def test_pages_name_the_layers_by_stack(tmp_path: Path, open_page) -> None:  # noqa: F811 (a fixture)
    from probe.heads.classify import classify
    from probe.patterns import attention_patterns
    from probe.reports.html import ablation_page, classification_page, heatmap_page

    model = tiny_encoder_decoder("bart")
    loaded = LoadedModel(model=model, tokenizer=None, name="bart", vocab_size=120)
    names = ["enc0", "enc1", "dec0", "x0", "dec1", "x1"]
    heads = [{"layer": layer, "head": head, "loss": 3.0, "delta": 0.01 * (layer + 1) * (head + 1)}
             for layer in range(6) for head in range(4)]
    path = tmp_path / "ablate.html"
    path.write_text(ablation_page({"model": "bart", "method": "zero", "baseline_loss": 3.0, "heads": heads,
                                   "n_layers": 6, "n_heads": 4, "layer_names": names}), encoding="utf-8")
    opened = open_page(path)
    assert tick_texts(opened, "y", ".probe-delta-plot") == names
    bars = opened.page.evaluate("document.querySelector('.probe-bar-plot').data[0]")
    assert bars["y"][0] == "x1.3" and bars["text"][0] == "layer x1, head 3"
    opened.check_clean()
    result = classify(loaded, seq_len=10, num_seqs=2, repeat_len=6)
    path = tmp_path / "classify.html"
    path.write_text(classification_page(result.to_dict()), encoding="utf-8")
    opened = open_page(path)
    assert tick_texts(opened, "y", ".probe-score-plot") == names
    opened.check_clean()
    patterns = attention_patterns(loaded, [2, 17, 33, 17, 33], source="ids").page_payload()
    path = tmp_path / "heatmap.html"
    path.write_text(heatmap_page(patterns), encoding="utf-8")
    opened = open_page(path)
    options = opened.page.evaluate("Array.from(document.querySelectorAll('.probe-layer option')).map(o => o.text)")
    assert options == [f"layer {name}" for name in names]
    labels = opened.page.evaluate("Array.from(document.querySelectorAll('.probe-grid-label')).map(s => s.textContent)")
    assert [label for label in labels if label in names] == names
    assert opened.page.text_content(".probe-plot-title").startswith("layer enc0, head")
    opened.check_clean()


def labels_loss(model: torch.nn.Module, probe_set: ProbeSet) -> float:
    """The model's own loss on a pairs set: the encoder reads the sources, `labels` are the targets after the start
    token (padding -100), from which the model builds the decoder's input itself."""
    labels = probe_set.input_ids[:, 1:].masked_fill(probe_set.attention_mask[:, 1:] == 0, -100).contiguous()
    with torch.no_grad():
        return float(model(input_ids=probe_set.source_ids, attention_mask=probe_set.source_mask, labels=labels).loss)


@pytest.mark.parametrize("name", SUPPORTED)
def test_source_target_pairs_give_the_models_labels_loss(name: str) -> None:
    from probe.inputs import pairs_set

    model = tiny_encoder_decoder(name)
    loaded = LoadedModel(model=model, tokenizer=None, name=name, vocab_size=120)
    torch.manual_seed(2)
    pairs = [(torch.randint(3, 120, (length,)).tolist(), torch.randint(3, 120, (length // 2 + 2,)).tolist())
             for length in (11, 6, 14)]
    probe_set = pairs_set(loaded, pairs)
    assert probe_set.source_ids.shape == (3, 14) and probe_set.input_ids.shape == (3, 10)
    before = snapshot(model)
    result = sweep(loaded, probe_set, parse_heads("x1.2,enc0.1", attention_layers(model)), mode="naive", batch_size=2)
    assert_unchanged(model, before)
    assert result.baseline_loss == pytest.approx(labels_loss(model, probe_set), abs=1e-5)
    with projection_input_zeroed(model, name, [("cross", 1, 2)], attention_layers(model)[0].head_dim):
        assert result.results[0].loss == pytest.approx(labels_loss(model, probe_set), abs=1e-5)
    with projection_input_zeroed(model, name, [("encoder", 0, 1)], attention_layers(model)[0].head_dim):
        assert result.results[1].loss == pytest.approx(labels_loss(model, probe_set), abs=1e-5)
    assert abs(result.results[0].delta) > 1e-4
    with pytest.raises(ProbeError, match="swept with method zero or .*window, not mean"):
        sweep(loaded, probe_set, [(5, 2)], method="mean")
    with pytest.raises(ProbeError, match="for encoder-decoders"):
        pairs_set(tiny_loaded("llama_gqa"), pairs)


def word_tokenizer(folder: Path, words: list[str]) -> None:
    """A word-level tokenizer (ids 3.. for the words) saved into the model folder, as a real one would be."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "</s>": 2, **{word: 3 + i for i, word in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>",
                            eos_token="</s>").save_pretrained(folder)


def test_ablate_reads_seq2seq_texts_from_a_file(tmp_path: Path, capsys, monkeypatch) -> None:
    from probe.models.hf import SAMPLE_TEXT

    monkeypatch.setenv("PROBE_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    tiny_encoder_decoder("t5").save_pretrained(folder)
    words = sorted(set(SAMPLE_TEXT.replace(".", " ").split()) | {"a", "cat", "sat", "on", "mat", "le", "chat"})
    word_tokenizer(folder, words)
    lines = [{"source": "The cat sat on the mat", "target": "le chat"}, {"source": "a fox", "target": "the lazy dog"}]
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps(line) for line in lines) + "\n", encoding="utf-8")
    code, out, err = run_cli(["ablate", "--model", str(folder), "--seq2seq", str(data), "--heads", "x0.1,dec1.0",
                              "--json", str(tmp_path / "pairs.json")], capsys, monkeypatch)
    assert code == 0, err
    result = json.loads((tmp_path / "pairs.json").read_text(encoding="utf-8"))
    loaded = load_model(str(folder))
    from probe.inputs import read_pairs

    probe_set = read_pairs(loaded, data)
    assert probe_set.source_ids.shape == (2, 6) and probe_set.input_ids.shape == (2, 4)  # start + 3 words
    assert result["baseline_loss"] == pytest.approx(labels_loss(loaded.model, probe_set), abs=1e-5)
    assert result["data"] == f"seq2seq file {data}" and "x0.1" in out
    code, out, err = run_cli(["ablate", "--model", str(folder), "--seq2seq", str(data), "--method", "mean"],
                             capsys, monkeypatch)
    assert code == 2 and "--method" in err and "not mean" in err


def test_heatmap_takes_layers_by_stack(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path / "cache"))
    folder = str(tmp_path / "model")
    tiny_encoder_decoder("t5").save_pretrained(folder)
    from probe.models.hf import SAMPLE_TEXT

    word_tokenizer(Path(folder), sorted(set(SAMPLE_TEXT.replace(".", " ").split()) | {"one", "two", "three"}))
    page = tmp_path / "heatmap.html"
    code, _, err = run_cli(["heatmap", "--model", folder, "--text", "one two three", "--layers", "x1,enc0",
                            "--html", str(page)], capsys, monkeypatch)
    assert code == 0, err
    drawn = {layer for layer, _ in page_data(page.read_text(encoding="utf-8"))["patterns"]["heads"]}
    assert drawn == {5, 0}  # x1 and enc0, by probe's flat index
    code, _, err = run_cli(["heatmap", "--model", folder, "--text", "one", "--layers", "3", "--html",
                            str(tmp_path / "other.html")], capsys, monkeypatch)
    errors = [line for line in err.splitlines() if not line.startswith("warning:")]
    assert code == 2 and len(errors) == 1
    assert "--layers '3': this encoder-decoder names its layers by stack" in errors[0]
    assert not (tmp_path / "other.html").exists()

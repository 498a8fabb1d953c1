"""Sequence classifiers: a tiny BERT classifier built from a config and a hand-written custom classifier are captured
and ablated as every model (capture equals eager attention, zero ablation equals a hand-edited output projection,
the exact sweep equals the naive loop); the classification metrics equal a hand computation; a planted classifier
whose decision is one head's shows that head first by accuracy; bad labelled input is one line."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from classifiers import (PLANTED_HEAD, planted_classifier, planted_texts, tiny_bert_classifier, tiny_classifier,
                         word_tokenizer)
from conftest import run_cli
from probe.ablation import ablate, sweep
from probe.ablation.prune import prune
from probe.ablation.sweep import baseline_metric
from probe.hooks.capture import capture_attention
from probe.hooks.run import logits_of, run_model
from probe.errors import ProbeError
from probe.inputs import LabelledText, ProbeOptions, build_probe_set, labelled_set
from probe.models import LoadedModel, load_model

WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "good", "bad", "film", "was", "very", "plot"]
ROWS = [("the cat sat on a mat", "positive"), ("a dog ran far", 0), ("good film", "neutral"), ("bad plot", 2),
        ("the film was very bad", "negative"), ("a cat ran", 1), ("very good dog", "positive")]


@pytest.fixture(scope="module")
def bert() -> LoadedModel:
    tokenizer = word_tokenizer(WORDS)
    return load_model(tiny_bert_classifier(len(tokenizer)), tokenizer=tokenizer, name="tiny-bert-classifier")


@pytest.fixture(scope="module")
def planted() -> LoadedModel:
    model, tokenizer = planted_classifier()
    return load_model(model, tokenizer=tokenizer, name="planted-classifier")


def rows_of(items: list[tuple[str, int | str]]) -> list[LabelledText]:
    return [LabelledText(text, label) for i, (text, label) in enumerate(items)]


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@contextmanager
def zeroed_projection_input(projection: torch.nn.Module, head: int, head_dim: int):
    """The reference ablation, by hand: head `head`'s slice of the output projection's input set to 0."""
    def zero(_module, args):
        edited = args[0].clone()
        edited[..., head * head_dim:(head + 1) * head_dim] = 0
        return (edited, *args[1:])
    handle = projection.register_forward_pre_hook(zero)
    try:
        yield
    finally:
        handle.remove()


def test_labelled_set_matches_labels_to_the_classes(bert: LoadedModel) -> None:
    probe_set = labelled_set(bert, rows_of(ROWS))
    assert probe_set.meta["classes"] == ["negative", "neutral", "positive"]
    assert probe_set.scored.shape == (7, 3) and probe_set.scored.sum(dim=1).tolist() == [1] * 7
    assert probe_set.scored.float().argmax(dim=1).tolist() == [2, 0, 1, 2, 0, 1, 2]
    assert probe_set.input_ids[:, 0].tolist() == [bert.tokenizer.cls_token_id] * 7 and probe_set.offset == 1
    pair = labelled_set(bert, [LabelledText("good film", "positive", "bad plot")])
    assert pair.input_ids[0].tolist() == bert.tokenizer("good film", "bad plot")["input_ids"]


def test_bert_classifier_capture_equals_eager(bert: LoadedModel) -> None:
    probe_set = labelled_set(bert, rows_of(ROWS))
    ids, mask = probe_set.input_ids, probe_set.attention_mask
    bert.model.config._attn_implementation_internal, saved = "eager", bert.model.config._attn_implementation_internal
    try:
        with torch.no_grad():
            reference = bert.model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    finally:
        bert.model.config._attn_implementation_internal = saved
    patterns = capture_attention(bert.model, ids, mask)
    rows = mask.bool()[:, None, :, None]
    for layer, pattern in patterns.items():
        assert (pattern - reference[layer]).abs().masked_select(rows).max() <= 1e-5


@pytest.mark.parametrize("which", ["bert", "planted"])
def test_zero_ablation_equals_a_hand_edited_projection_and_the_metric_a_hand_computation(
        which: str, bert: LoadedModel, planted: LoadedModel) -> None:
    loaded = bert if which == "bert" else planted
    rows = rows_of(ROWS) if which == "bert" else [LabelledText(r["text"], r["label"])
                                                  for r in planted_texts(12)]
    probe_set = labelled_set(loaded, rows)
    ids, mask = probe_set.input_ids, probe_set.attention_mask
    gold = probe_set.scored.float().argmax(dim=1)
    projection = (loaded.model.bert.encoder.layer[1].attention.output.dense if which == "bert"
                  else loaded.model.attention.W_o)
    layer, head = (1, 3) if which == "bert" else PLANTED_HEAD
    with torch.no_grad():
        baseline = logits_of(run_model(loaded.model, ids, mask))
        with zeroed_projection_input(projection, head, 64 // 4 if which == "bert" else 8):
            edited = logits_of(run_model(loaded.model, ids, mask))
        with ablate(loaded.model, [(layer, head)]):
            ablated = logits_of(run_model(loaded.model, ids, mask))
    assert baseline.shape == (len(rows), len(probe_set.meta["classes"]))
    assert (edited - baseline).abs().max() > 1e-4 and (ablated - edited).abs().max() <= 1e-5
    ce, figures = baseline_metric(loaded, probe_set, metric="class_cross_entropy", batch_size=3)
    assert ce == pytest.approx(float(F.cross_entropy(baseline, gold)), abs=1e-6)
    error, figures = baseline_metric(loaded, probe_set, metric="accuracy", batch_size=3)
    accuracy = float((baseline.argmax(dim=1) == gold).double().mean())
    assert figures == {"accuracy": pytest.approx(accuracy)} and error == pytest.approx(1 - accuracy)
    result = sweep(loaded, probe_set, [(layer, head)], metric="class_cross_entropy", batch_size=3)
    assert result.results[0].loss == pytest.approx(float(F.cross_entropy(edited, gold)), abs=1e-5)


def test_exact_sweep_equals_the_naive_loop_on_a_bert_classifier(bert: LoadedModel) -> None:
    probe_set = labelled_set(bert, rows_of(ROWS))
    for metric in ("class_cross_entropy", "accuracy"):
        naive = sweep(bert, probe_set, metric=metric, mode="naive", batch_size=3)
        exact = sweep(bert, probe_set, metric=metric, mode="exact", batch_size=3, stack=4)
        assert exact.path.startswith("exact") and naive.path.startswith("naive")
        assert [r.heads for r in exact.results] == [r.heads for r in naive.results] and len(exact.results) == 8
        for a, b in zip(exact.results, naive.results):
            assert a.loss == pytest.approx(b.loss, abs=1e-5)


@pytest.mark.parametrize("kind", ["llama", "roberta", "distilbert"])
def test_exact_sweep_equals_the_naive_loop_on_other_classifiers(kind: str, bert: LoadedModel) -> None:
    """A causal classifier (Llama: pooled at the last token) and two more encoders, through the exact path."""
    loaded = load_model(tiny_classifier(kind, len(bert.tokenizer)), tokenizer=bert.tokenizer, name=kind)
    probe_set = labelled_set(loaded, rows_of([(text, i % 3) for i, (text, _) in enumerate(ROWS[:4])]))  # LABEL_0..2
    exact = sweep(loaded, probe_set, batch_size=2, stack=3)
    naive = sweep(loaded, probe_set, batch_size=2, mode="naive")
    assert exact.path.startswith("exact") and max(abs(r.delta) for r in naive.results) > 1e-3
    for a, b in zip(exact.results, naive.results):
        assert a.loss == pytest.approx(b.loss, abs=1e-5)


def test_planted_head_comes_first_by_accuracy_and_prunes_last_by_michel(planted: LoadedModel) -> None:
    rows = [LabelledText(r["text"], r["label"]) for r in planted_texts(16)]
    probe_set = labelled_set(planted, rows)
    result = sweep(planted, probe_set, metric="accuracy", batch_size=8)
    assert result.baseline_loss == 0.0 and result.task == {"accuracy": 1.0}
    ranked = sorted(result.results, key=lambda r: -r.delta)
    assert ranked[0].heads == (PLANTED_HEAD,) and ranked[0].delta == pytest.approx(0.5)  # every "good" text lost
    assert all(r.delta == 0.0 for r in ranked[1:])
    assert result.to_dict()["metric"] == "accuracy"
    pruned = prune(planted, probe_set, orderings=["michel"], step=0.25, metric="accuracy", batch_size=8)
    steps = pruned.curves[0].steps
    assert [step.loss for step in steps] == [0.0, 0.0, 0.0, 0.0, 0.5]  # the planted head goes last


def test_bad_labelled_input_is_one_line(bert: LoadedModel, tmp_path: Path) -> None:
    with pytest.raises(ProbeError, match=r"row 2: label 7 is outside the model's 3 classes"):
        labelled_set(bert, rows_of([("a cat", 0), ("a dog", 7)]))
    with pytest.raises(ProbeError, match=r"row 1: label 'happy' is not one of the model's classes"):
        labelled_set(bert, rows_of([("a cat", "happy")]))
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "a cat", "label": 0}\n{"text": "a dog"}\n', encoding="utf-8")
    with pytest.raises(ProbeError, match=r"line 2: a class \(\"label\"\) is an integer"):
        build_probe_set("labels", bert, ProbeOptions(labels=path))


def test_cli_ablate_labels_and_its_refusals(tmp_path: Path, capsys, monkeypatch) -> None:
    spec = f"{Path(__file__).parent / 'classifiers.py'}:planted_classifier"
    labels = write_rows(tmp_path / "labels.jsonl", planted_texts(8))
    out = tmp_path / "out.json"
    code, _stdout, stderr = run_cli(["ablate", "--model", spec, "--labels", str(labels), "--metric", "accuracy",
                                    "--json", str(out)], capsys, monkeypatch)
    assert code == 0, stderr
    payload = json.loads(out.read_text())
    top = max(payload["heads"], key=lambda r: r["delta"])
    assert (top["layer"], top["head"]) == PLANTED_HEAD and top["delta"] == pytest.approx(0.5)
    assert payload["metric"] == "accuracy" and payload["baseline_task"] == {"accuracy": 1.0}
    assert payload["probe_set"]["classes"] == ["bad", "good"] and payload["data"].endswith("labels.jsonl")
    outside = write_rows(tmp_path / "outside.jsonl", [{"text": "good film", "label": 5}])
    code, _, stderr = run_cli(["ablate", "--model", spec, "--labels", str(outside)], capsys, monkeypatch)
    assert code == 2 and stderr.strip().count("\n") == 0 and "outside the model's 2 classes" in stderr
    headless = f"{Path(__file__).parent / 'classifiers.py'}:headless_bert"
    code, _, stderr = run_cli(["ablate", "--model", headless, "--labels", str(labels)], capsys, monkeypatch)
    assert code == 2 and stderr.strip().count("\n") == 0 and "no classification head" in stderr
    code, _, stderr = run_cli(["ablate", "--model", spec, "--num-seqs", "2", "--seq-len", "8"], capsys, monkeypatch)
    assert code == 2 and stderr.strip().count("\n") == 0 and "sequence classifier" in stderr


def test_sep_and_sink_heads_of_a_planted_classifier(planted: LoadedModel) -> None:
    """The labelled set is [CLS] text [SEP], right-padded: 0.0 attends to [SEP], 0.1 to [CLS], on both paths."""
    from probe.heads.classify import score_heads

    probe_set = labelled_set(planted, [LabelledText(r["text"], r["label"])
                                       for r in planted_texts(6)])
    assert probe_set.attention_mask.sum(dim=1).unique().numel() > 1  # padded rows: [SEP] is each row's own last
    for path in ("blocked", "lse"):
        scores = score_heads(planted, probe_set, ["sep", "sink"], batch_size=3, path=path)
        assert scores["sep"][0, 0] > 0.99 and scores["sep"][0, 1:].max() < 0.5, path
        assert scores["sink"][0, 1] > 0.99 and scores["sink"][0, [0, 2, 3]].max() < 0.5, path


def test_a_saved_classifier_folder_loads_as_a_classifier_and_the_estimate_refuses_it(tmp_path: Path) -> None:
    from probe.ablation import estimate

    tokenizer = word_tokenizer(WORDS + ["quick", "brown", "fox", "jumps"])  # words probe's tokenizer check encodes
    tiny_bert_classifier(len(tokenizer)).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    loaded = load_model(str(tmp_path / "model"))
    assert type(loaded.model).__name__ == "BertForSequenceClassification"
    probe_set = build_probe_set("labels", loaded, ProbeOptions(labels=write_rows(
        tmp_path / "rows.jsonl", [{"text": "good film", "label": "positive"}, {"text": "a bad plot", "label": 0},
                                  {"text": "a cat", "text_pair": "a dog", "label": "neutral"}])))
    assert probe_set.meta["class_counts"] == [1, 1, 1]
    with pytest.raises(ProbeError, match="not a classifier's labelled texts"):
        estimate(loaded, probe_set)


PAIRS = [{"clean": "the film was good", "corrupt": "the film was bad", "answer": "good", "distractor": "bad"},
         {"clean": "a good plot so very", "corrupt": "a bad plot so very", "answer": "good", "distractor": 0},
         {"clean": "it was good and", "corrupt": "it was bad and", "answer": 1, "distractor": "bad"}]


def test_patching_by_class_logit_difference(planted: LoadedModel, bert: LoadedModel, tmp_path: Path) -> None:
    """Clean/corrupt texts scored by logit(answer class) - logit(distractor class): the planted decision head
    restores all of it and no other head any; the numbers are the class logits' own; exact equals naive on BERT."""
    from probe.inputs import read_class_pairs
    from probe.patching import patch_contrast

    contrast = read_class_pairs(planted, write_rows(tmp_path / "pairs.jsonl", PAIRS))
    assert contrast.classes == ["bad", "good"] and contrast.answer.tolist() == [1, 1, 1]
    with torch.no_grad():
        logits = logits_of(run_model(planted.model, contrast.clean, contrast.mask))
    result = patch_contrast(planted, contrast, batch_size=2)
    assert result.clean_logit_diff == pytest.approx(float((logits[:, 1] - logits[:, 0]).mean()), abs=1e-5)
    effects = {entry.heads[0]: entry.patch_effect for entry in result.entries}
    assert effects[PLANTED_HEAD] == pytest.approx(1.0, abs=1e-6)
    assert all(abs(value) < 1e-6 for head, value in effects.items() if head != PLANTED_HEAD)
    assert "classifier" in result.dla_note
    estimated = patch_contrast(planted, contrast, batch_size=2, estimate=True)
    assert max(estimated.entries, key=lambda entry: entry.patch_effect).heads == (PLANTED_HEAD,)
    rows = [{"clean": "good film", "corrupt": "bad film", "answer": "positive", "distractor": "negative"},
            {"clean": "a cat ran far", "corrupt": "a dog ran far", "answer": 0, "distractor": "neutral"}]
    sharp = load_model(tiny_bert_classifier(len(bert.tokenizer), initializer_range=0.5), tokenizer=bert.tokenizer,
                       name="sharp-bert")  # larger weights: the two texts' class logits differ by more than MIN_GAP
    on_bert = read_class_pairs(sharp, write_rows(tmp_path / "bert.jsonl", rows))
    exact, naive = (patch_contrast(sharp, on_bert, batch_size=1, mode=mode) for mode in ("exact", "naive"))
    assert exact.path.startswith("exact") and naive.path.startswith("naive")
    for a, b in zip(exact.entries, naive.entries):
        assert a.logit_diff == pytest.approx(b.logit_diff, abs=1e-5)


def test_cli_patch_labels(tmp_path: Path, capsys, monkeypatch) -> None:
    spec = f"{Path(__file__).parent / 'classifiers.py'}:planted_classifier"
    out = tmp_path / "patch.json"
    pairs = write_rows(tmp_path / "pairs.jsonl", PAIRS)
    code, _, stderr = run_cli(["patch", "--model", spec, "--labels", str(pairs), "--no-classes", "--json", str(out)],
                              capsys, monkeypatch)
    assert code == 0, stderr
    heads = {(h["layer"], h["head"]): h["patch_effect"] for h in json.loads(out.read_text())["heads"]}
    assert heads[PLANTED_HEAD] == pytest.approx(1.0)
    uneven = write_rows(tmp_path / "uneven.jsonl", [{**PAIRS[0], "corrupt": "the film was so bad"}])
    code, _, stderr = run_cli(["patch", "--model", spec, "--labels", str(uneven), "--no-classes"], capsys, monkeypatch)
    assert code == 2 and stderr.strip().count("\n") == 0 and "line 1: clean is 6 tokens and corrupt 7" in stderr

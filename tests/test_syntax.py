"""Syntactic heads (probe.syntax): CoNLL-U reading, word <-> token alignment, the Clark et al. scores against a
planted head, and spaCy parses where the extra is installed."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

from planted_syntax import conllu_corpus, planted_syntax, syntax_tokenizer
from probe.errors import ProbeError
from probe.hooks.capture import capture_attention
from probe.syntax import read_conllu, syntax_scores
from probe.syntax.scores import TO_HEAD, align, word_attention

SPLIT = """# text = go walking,now
1-2\tgo walking\t_\t_\t_\t_\t_\t_\t_\t_
1\tgo\tgo\tVERB\t_\t_\t0\troot\t_\t_
2\twalking\twalk\tVERB\t_\t_\t1\txcomp\t_\tSpaceAfter=No
2.1\telided\t_\t_\t_\t_\t_\t_\t_\t_
3\tnow\tnow\tADV\t_\t_\t2\tadvmod:tmod\t_\t_

"""
HAS_SPACY = importlib.util.find_spec("spacy") is not None


def write(tmp_path, text, name="parses.conllu"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_conllu_skips_multiword_and_empty_lines_and_aligns_split_words(tmp_path):
    (sentence,) = read_conllu(write(tmp_path, SPLIT))
    assert sentence.words == ["go", "walking", "now"]
    assert sentence.heads == [-1, 0, 1] and sentence.relations == ["root", "xcomp", "advmod"]
    assert sentence.text == "go walkingnow"  # SpaceAfter=No
    tokenizer = syntax_tokenizer()
    aligned = align(tokenizer, sentence)
    tokens = tokenizer.convert_ids_to_tokens(aligned.ids)
    assert tokens == ["[BOS]", "go", "walk", "##ing", "##now"]  # "walkingnow" is one whitespace word
    assert aligned.members == [[1], [2, 3], [4]]
    weights = torch.rand(2, 5, 5).softmax(dim=-1)  # (heads, tokens, tokens)
    words = word_attention(weights, aligned)
    assert words.shape == (2, 3, 3)
    # to a split word: the sum over its tokens; from it: the mean over its tokens
    torch.testing.assert_close(words[:, 0, 1], weights[:, 1, 2] + weights[:, 1, 3])
    expected = (weights[:, 2, 1] + weights[:, 3, 1]) / 2
    torch.testing.assert_close(words[:, 1, 0], expected)


def test_split_words_with_spaces(tmp_path):
    text = SPLIT.replace("SpaceAfter=No", "_")
    (sentence,) = read_conllu(write(tmp_path, text))
    aligned = align(syntax_tokenizer(), sentence)
    assert sentence.text == "go walking now" and aligned.members == [[1], [2, 3], [4]]


@pytest.mark.parametrize("line, message", [
    ("1\tgo\tgo\tVERB\t_\t_\t0\troot\t_", "10 tab-separated fields, this one has 9"),
    ("2\tgo\tgo\tVERB\t_\t_\t0\troot\t_\t_", "word ID '2' where 1 was expected"),
    ("1\tgo\tgo\tVERB\t_\t_\tx\troot\t_\t_", "HEAD must be a word ID or 0"),
    ("1\tgo\tgo\tVERB\t_\t_\t0\t_\t_\t_", "DEPREL is missing"),
    ("1\tgo\tgo\tVERB\t_\t_\t5\troot\t_\t_", "names head 5, but sentence 2 has 1 words"),
])
def test_malformed_conllu_lines_name_file_and_line(tmp_path, line, message):
    path = write(tmp_path, SPLIT + "# second\n" + line + "\n")
    with pytest.raises(ProbeError) as error:
        read_conllu(path)
    assert f"{path}:9" in str(error.value) and message in str(error.value)


def test_empty_or_missing_conllu(tmp_path):
    with pytest.raises(ProbeError, match="holds no sentence"):
        read_conllu(write(tmp_path, "# only a comment\n"))
    with pytest.raises(ProbeError, match="not found"):
        read_conllu(tmp_path / "missing.conllu")


def test_a_tokenizer_without_offsets_is_a_clear_error(tmp_path):
    from transformers import BertTokenizerLegacy  # a slow (Python) tokenizer: no offset mapping

    vocab = write(tmp_path, "\n".join(["[PAD]", "[UNK]", "go", "walk", "##ing", "now"]), "vocab.txt")
    (sentence,) = read_conllu(write(tmp_path, SPLIT))
    with pytest.raises(ProbeError, match="no character offsets") as error:
        align(BertTokenizerLegacy(vocab_file=str(vocab)), sentence)
    assert error.value.parameter == "model"


def test_planted_head_scores_one_and_the_baseline_does_not(tmp_path):
    loaded = planted_syntax()
    sentences = read_conllu(write(tmp_path, conllu_corpus(24)))
    result = syntax_scores(loaded, sentences, scheme="ud", source="planted", batch_size=1, min_count=5)
    assert result.causal
    for relation in ("advmod", "obj"):
        tally = result.relations[(relation, TO_HEAD)]
        accuracy = tally.accuracy()
        offset, baseline = tally.baseline()
        assert tally.count >= 5
        assert accuracy[0, 0] == 1.0  # the planted head finds every gold head
        assert baseline < 0.8 and offset == -1
        assert accuracy[0, 1] == pytest.approx(baseline)  # the previous-token head is the -1 baseline
        assert float(accuracy[0, 2:].max()) < 1.0
    syntactic = result.syntactic()
    assert syntactic[(0, 0)] == ["obj dep->head", "advmod dep->head"] and (0, 1) not in syntactic
    assert result.excess()[0, 0] == pytest.approx(1.0 - result.relations[("obj", TO_HEAD)].baseline()[1]) or \
        result.excess()[0, 0] == pytest.approx(1.0 - result.relations[("advmod", TO_HEAD)].baseline()[1])
    # confident attention: ~1 from each dependent to the verb (on an arc), 0.5 from the verb to itself (its query
    # is blank: 0.5 on BOS, excluded, and 0.5 on itself, not an arc)
    arcs = sum(tally.count for tally in result.relations.values())
    share = result.confident_share
    assert share[0, 0] == pytest.approx(arcs / (arcs + 0.5 * len(sentences)), rel=1e-4)
    assert float(share[0, 1:].max()) < share[0, 0]
    payload = result.to_dict()
    assert payload["scheme"] == "ud" and payload["syntactic"][0] == {
        "layer": 0, "head": 0, "relations": ["obj dep->head", "advmod dep->head"]}
    example = payload["examples"][0]
    assert example["hits"][0] == list(range(len(example["arcs"])))  # head 0 gets every arc of the sentence


def test_batches_with_padding_match_one_sentence_at_a_time(tmp_path):
    from conftest import tiny_hf

    from probe.models import LoadedModel

    model = tiny_hf("llama_gqa")
    loaded = LoadedModel(model=model, tokenizer=syntax_tokenizer(), name="tiny", vocab_size=120)
    sentences = read_conllu(write(tmp_path, conllu_corpus(6)))
    one = syntax_scores(loaded, sentences, scheme="ud", source="t", batch_size=1, min_count=1)
    batched = syntax_scores(loaded, sentences, scheme="ud", source="t", batch_size=4, min_count=1)
    for key, tally in one.relations.items():
        torch.testing.assert_close(tally.hits, batched.relations[key].hits)
    torch.testing.assert_close(one.confident_share, batched.confident_share)
    # the word attention is the captured attention, regrouped
    aligned = align(loaded.tokenizer, sentences[0])
    captured = capture_attention(model, torch.tensor([aligned.ids]))
    assert word_attention(captured[0][0], aligned).shape == (2, 4, len(sentences[0].words),
                                                            len(sentences[0].words))[1:]


def test_sentences_longer_than_the_context_are_skipped_with_one_line(tmp_path):
    loaded = planted_syntax()
    long = "1\tgo\tgo\t_\t_\t_\t0\troot\t_\t_\n" + "".join(
        f"{i}\tnow\tnow\t_\t_\t_\t1\tadvmod\t_\t_\n" for i in range(2, 300)) + "\n"
    sentences = read_conllu(write(tmp_path, conllu_corpus(3) + long))
    result = syntax_scores(loaded, sentences, scheme="ud", source="t", min_count=1)
    assert result.sentences == 3
    assert len(result.skipped) == 1 and "300 tokens, longer than the model's context of 256" in result.skipped[0]


@pytest.mark.skipif(not HAS_SPACY, reason="spaCy is not installed (pip install 'probe-heads[syntax]')")
def test_spacy_parses_prose_and_refuses_text_without_sentences():
    from probe.syntax.parse import parse_text

    sentences = parse_text("Heading\n*******\n\nThe cat sat on the mat. It did not move.\n\n    code = 1\n",
                           source="t")
    assert [s.words for s in sentences] == [["The", "cat", "sat", "on", "the", "mat", "."],
                                            ["It", "did", "not", "move", "."]]
    first = sentences[0]
    assert first.relations[0] == "det" and first.heads[0] == 1 and first.heads[2] == -1
    assert first.text[slice(*first.spans[5])] == "mat"
    with pytest.raises(ProbeError, match="found no sentence"):
        parse_text("    indented = code\n\n!!!\n", source="t")


def test_cli_end_to_end(tmp_path, capsys, monkeypatch):
    import csv
    import json

    from conftest import run_cli

    corpus = write(tmp_path, conllu_corpus(16))
    out = {kind: tmp_path / f"syntax.{kind}" for kind in ("json", "csv", "html")}
    args = ["syntax", "--model", "tests/planted_syntax.py:planted_pair", "--conllu", str(corpus), "--min-count", "5"]
    code, stdout, stderr = run_cli(args + [item for kind, path in out.items() for item in (f"--{kind}", str(path))],
                                   capsys, monkeypatch)
    assert code == 0, stderr
    payload = json.loads(out["json"].read_text())
    assert payload["scheme"] == "ud" and payload["sentences"] == 16
    assert payload["syntactic"][0]["layer"] == 0 and payload["syntactic"][0]["head"] == 0
    obj = next(e for e in payload["relations"] if e["relation"] == "obj")
    assert obj["best"][0] == {"layer": 0, "head": 0, "accuracy": 1.0, "margin": round(1.0 - obj["baseline"], 4)}
    rows = list(csv.DictReader(out["csv"].open()))
    assert len(rows) == len(payload["relations"]) * 4
    assert "Universal Dependencies" in stdout and "obj" in stdout and "0.0" in stdout
    grid = stdout[stdout.index("Overview, layer x head"):].splitlines()
    assert grid[2].split()[:2] == ["0", "2"], grid  # layer 0, head 0: syntactic for obj and advmod
    assert "<h1>Syntactic heads of planted_syntax" in out["html"].read_text() or "Syntactic heads" in \
        out["html"].read_text()
    code, _, stderr = run_cli(args[:-2] + ["--min-count", "0"], capsys, monkeypatch)
    assert code == 2 and stderr.strip() == "error: --min-count must be at least 1, got 0"
    bad = write(tmp_path, "1\tgo\n", "bad.conllu")
    code, _, stderr = run_cli(["syntax", "--model", "tests/planted_syntax.py:planted_pair", "--conllu", str(bad)],
                              capsys, monkeypatch)
    assert code == 2 and stderr.strip() == (f"error: {bad}:1: a CoNLL-U word line has 10 tab-separated fields, "
                                            "this one has 2")


def test_classify_gains_the_syntactic_class_from_parses(tmp_path, capsys, monkeypatch):
    import json

    from conftest import run_cli

    corpus = write(tmp_path, conllu_corpus(40))
    out = tmp_path / "classes.json"
    code, stdout, stderr = run_cli(["classify", "--model", "tests/planted_syntax.py:planted_pair", "--seq-len", "16",
                                    "--num-seqs", "2", "--repeat-len", "8", "--conllu", str(corpus), "--json",
                                    str(out), "--html", str(tmp_path / "classes.html")], capsys, monkeypatch)
    assert code == 0, stderr
    payload = json.loads(out.read_text())
    assert payload["classes"]["syntactic"]["letter"] == "Y"
    assert payload["thresholds"]["syntactic"] == 0.1
    labels = {(e["layer"], e["head"]): e["labels"] for e in payload["heads"]}
    assert "syntactic" in labels[(0, 0)] and "syntactic" not in labels[(0, 1)]
    assert "previous_token" in labels[(0, 1)]  # next to the positional classes
    assert payload["flagged"]["syntactic"][0]["layer"] == 0 and payload["flagged"]["syntactic"][0]["head"] == 0
    assert "syntactic heads:" in stdout and "y=syntactic (light: on 3 of 4 heads)" in stdout
    page = (tmp_path / "classes.html").read_text()
    assert 'data-score="syntactic"' in page and re.search(r"syntactic: \d+ heads? flagged", page)


def test_an_encoder_scores_both_directions_with_cls_and_sep(tmp_path):
    from conftest import tiny_hf
    from transformers import PreTrainedTokenizerFast

    from probe.models import LoadedModel

    tokenizer = syntax_tokenizer()
    encoder_tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, cls_token="[BOS]",
                                                sep_token="[PAD]", pad_token="[PAD]", unk_token="[UNK]")
    loaded = LoadedModel(model=tiny_hf("bert"), tokenizer=encoder_tokenizer, name="tiny-bert", vocab_size=120)
    sentences = read_conllu(write(tmp_path, conllu_corpus(4)))
    aligned = align(encoder_tokenizer, sentences[0], encoder=True)
    assert aligned.ids[0] == encoder_tokenizer.cls_token_id and aligned.ids[-1] == encoder_tokenizer.sep_token_id
    result = syntax_scores(loaded, sentences, scheme="ud", source="t", min_count=1)
    assert not result.causal
    arcs = sum(len(s.arcs()) for s in sentences)
    by_direction = {d: sum(t.count for (_, dd), t in result.relations.items() if dd == d) for d in (TO_HEAD,
                                                                                                  "head->dep")}
    assert by_direction == {TO_HEAD: arcs, "head->dep": arcs}  # Clark et al.: every arc, both ways


@pytest.mark.skipif(not HAS_SPACY, reason="spaCy is not installed (pip install 'probe-heads[syntax]')")
def test_cli_parses_text_with_spacy_and_names_the_scheme(tmp_path, capsys, monkeypatch):
    import json

    from conftest import run_cli

    text = write(tmp_path, "We go home now. They run fast today. I walk there slowly.\n\n", "t.txt")
    out = tmp_path / "s.json"
    model = ["syntax", "--model", "tests/planted_syntax.py:planted_pair"]
    code, stdout, stderr = run_cli(model + ["--file", str(text), "--min-count", "1", "--json", str(out)],
                                   capsys, monkeypatch)
    assert code == 0, stderr
    payload = json.loads(out.read_text())
    assert payload["scheme"] == "clearnlp" and payload["sentences"] == 3 and "spaCy" in payload["source"]
    assert {e["relation"] for e in payload["relations"]} >= {"nsubj", "advmod", "punct"}
    assert "ClearNLP" in stdout
    empty = write(tmp_path, "    code = 1\n\n****\n", "code.txt")
    code, _, stderr = run_cli(model + ["--file", str(empty)], capsys, monkeypatch)
    assert code == 2 and stderr.strip() == (f"error: spaCy found no sentence of 3 or more words in {empty} (prose "
                                            "paragraphs: not indented, with letters)")
    code, _, stderr = run_cli(model + ["--file", str(empty), "--conllu", str(empty)], capsys, monkeypatch)
    assert code == 2 and stderr.strip() == "error: give --conllu or --file, not both"


def test_without_spacy_parsing_is_one_clear_error(monkeypatch):
    import sys

    from probe.syntax.parse import parse_text

    monkeypatch.setitem(sys.modules, "spacy", None)  # what `import spacy` meets where the extra is not installed
    with pytest.raises(ProbeError, match=r"parsing text needs spaCy: pip install 'probe-heads\[syntax\]'"):
        parse_text("The cat sat on the mat.")


def test_the_command_without_spacy_says_how_to_install_it_and_names_conllu(capsys, monkeypatch):
    import sys

    from conftest import run_cli

    monkeypatch.setitem(sys.modules, "spacy", None)
    monkeypatch.setattr("probe.cli.syntax.load", lambda *args: pytest.fail("the model loads before the refusal"))
    code, _, stderr = run_cli(["syntax", "--model", "tests/planted_syntax.py:planted_pair"], capsys, monkeypatch)
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert "pip install 'probe-heads[syntax]'" in stderr and "--conllu FILE" in stderr and "(conllu)" not in stderr


def test_a_margin_of_exactly_the_threshold_is_not_syntactic():
    from probe.syntax.result import SyntaxResult
    from probe.syntax.scores import RelationTally

    tally = RelationTally(torch.tensor([[16.0, 15.0]], dtype=torch.float64), count=20)
    tally.offsets[-1] = 14  # baseline 14/20 = 0.7; head 0.0: 16/20 = 0.8, 0.1 above it (0.10000000000000009 in floats)
    result = SyntaxResult(model="m", scheme="ud", source="s", causal=True, n_layers=1, n_heads=2, sentences=1,
                          words=1, relations={("obj", TO_HEAD): tally}, confident_share=torch.zeros(1, 2),
                          confident=0.4, min_count=20, margin=0.1)
    assert result.syntactic() == {}
    assert float(result.excess()[0, 0]) == 0.1
    tally.hits[0, 0] = 17.0
    assert result.syntactic() == {(0, 0): ["obj dep->head"]}

"""probe atlas on a planted model (tests/planted.py: previous-token head 0.0, sink head 0.1, induction head 1.1),
with its embedding and LM head as modules so that the copying score and the OV circuit can be read: every dashboard
field equals what the stand-alone function computes, and the evidence rules label the planted heads."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli
from planted import planted_lm
from probe import Atlas
from probe.atlas import atlas
from probe.ablation import sweep
from probe.circuits import copying_scores
from probe.circuits.pairs import circuits
from probe.heads.classify import classify
from probe.dla import next_token_attribution
from probe.headvis import METRICS as HEADVIS_METRICS
from probe.headvis import head_metrics
from probe.inputs import ProbeOptions, build_probe_set, natural_set
from probe.heads.evidence import HeadFacts, Partner, judge
from probe.models import LoadedModel
from probe.reports.atlas import atlas_page
from test_browser import assert_pattern, browser, open_page, screenshot  # noqa: F401 (fixtures)
from test_html import IMG, SCRIPT

OPTIONS = {"seq_len": 64, "num_seqs": 4, "repeat_len": 20}


@pytest.fixture(scope="module")
def planted() -> LoadedModel:
    return LoadedModel(model=planted_lm(), tokenizer=None, name="planted", vocab_size=200)


IDS = torch.randint(0, 200, (2, 30), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def built(planted: LoadedModel, tmp_path_factory) -> Atlas:
    before = planted.model(IDS)
    folder = tmp_path_factory.mktemp("runs")
    result = atlas(planted, results_dir=folder, **OPTIONS)
    assert torch.equal(planted.model(IDS), before)  # the model is left as it was
    assert (folder / "ablation.jsonl").is_file()  # the sweep streamed there, for --resume
    return result


@pytest.mark.slow
def test_classes_equal_classify(planted, built):
    alone = classify(planted, **OPTIONS)
    for entry in built.heads:
        layer, head = entry["layer"], entry["head"]
        assert [label["class"] for label in entry["classes"]] == sorted(
            alone.labels(layer, head), key=[label["class"] for label in entry["classes"]].index)
        assert set(label["class"] for label in entry["classes"]) == set(alone.labels(layer, head))
        for name, score in alone.scores.items():
            assert entry["metrics"][f"{name}_score"] == pytest.approx(float(score[layer, head]), abs=1e-6)
        for label in entry["classes"]:
            assert label["threshold"] == alone.thresholds[label["class"]]
    assert built.head(1, 1)["pattern"] == "repeated"  # the induction head's pattern: on the input that earned it


def test_causal_and_weight_fields_equal_ablate_and_circuits(planted, built):
    alone = sweep(planted, natural_set(planted, seq_len=64, num_seqs=4))
    for result in alone.heads:
        entry = built.head(result.layer, result.head)
        assert entry["metrics"]["delta"] == pytest.approx(result.delta, abs=1e-9)
        assert entry["metrics"]["specificity"] == pytest.approx(result.effects["specificity"], abs=1e-6)
        assert entry["effects"]["top_tokens"] == result.effects["top_tokens"]
    checked = circuits(planted, **OPTIONS)
    pair = next(pair for pair in checked.pairs if pair.induction == (1, 1))
    assert pair.checked == (0, 0)
    assert built.head(1, 1)["metrics"]["second_repeat_delta"] == pytest.approx(pair.deltas["induction"], abs=1e-6)
    assert built.head(0, 0)["metrics"]["second_repeat_delta"] == pytest.approx(pair.deltas["feeder"], abs=1e-6)
    feeders = [p for p in built.head(1, 1)["partners"]["feeders"] if p["kind"] == "k"]
    assert [((p["layer"], p["head"]), p["score"]) for p in feeders] == [
        (feeder.head, pytest.approx(feeder.score, abs=1e-6)) for feeder in pair.feeders if feeder.score > 0]
    assert feeders[0]["layer"] == feeders[0]["head"] == 0  # the previous-token head feeds the induction head's keys
    readers = built.head(0, 0)["partners"]["readers"]
    assert (readers[0]["layer"], readers[0]["head"], readers[0]["kind"]) == (1, 1, "k")
    copying = copying_scores(planted.model)
    for entry in built.heads:
        assert entry["metrics"]["copying"] == pytest.approx(float(copying[entry["layer"], entry["head"]]), abs=1e-6)
    writes = built.head(1, 1)["writes"]
    assert writes and all(write["promotes"][0]["token"] == write["token"] for write in writes)  # it copies


def test_headvis_metrics_equal_head_metrics(planted, built):
    alone = head_metrics(planted, natural_set(planted, seq_len=64, num_seqs=4), samples=0)
    for entry in built.heads:
        for name in HEADVIS_METRICS:
            value = float(alone.metrics[name][entry["layer"], entry["head"]])
            assert entry["metrics"][f"headvis_{name}"] == pytest.approx(value, abs=1e-6)
    assert {f"headvis_{name}" for name in HEADVIS_METRICS} <= set(built.to_dict()["metrics"])  # the finder's axes


def test_examples_show_what_the_head_does(planted, built):
    ids = natural_set(planted, seq_len=64, num_seqs=4).input_ids
    for example in built.head(0, 0)["examples"][:5]:  # previous-token head: its top key is the token before
        assert example["top_key"] == example["position"] - 1
    for example in built.head(1, 1)["examples"][:5]:  # induction: the key after an earlier copy of the query's token
        row = ids[example["sequence"]]
        assert example["top_weight"] > 0.9 and row[example["top_key"] - 1] == row[example["position"]]
    examples = built.head(1, 1)["examples"]
    assert [e["decile"] for e in examples][-3:] == [6, 8, 10]  # and some from lower deciles
    norms = [e["norm"] for e in examples]
    assert norms == sorted(norms, reverse=True)
    last = examples[0]["spans"][-1]
    assert last["first"] + len(last["tokens"]) - 1 == examples[0]["position"]
    assert len(last["weights"]) == len(last["tokens"])


def test_evidence_labels_the_planted_heads(built):
    induction = built.head(1, 1)["classes"][0]
    assert induction["class"] == "induction"
    assert induction["evidence"]["text"] == "confirmed by pattern, weights and cause"
    previous = built.head(0, 0)["classes"][0]
    assert previous["class"] == "previous_token" and previous["evidence"]["status"] == "confirmed"
    sink = built.head(0, 1)["classes"][0]
    assert sink["class"] == "sink" and sink["evidence"]["text"] == "pattern only"  # it writes where nothing reads
    summary = built.summary
    assert "0.1 sink" in summary["pattern_only"]
    payload = built.to_dict()
    json.dumps(payload, allow_nan=False)  # strict JSON
    assert {stage["name"] for stage in payload["stages"]} >= {"classify", "composition", "ablation", "examples"}
    dla = next(stage for stage in payload["stages"] if stage["name"] == "dla")
    assert dla["note"].startswith("skipped: ")  # no block list: DLA says why, the rest stands


def test_evidence_rule_without_weights_support():
    facts = HeadFacts(2, 0, {"induction"}, delta=0.5, copying=0.8, baseline=0.04,
                      feeders=[Partner(1, 3, "k", 0.2)], flagged={"previous_token": {(1, 0)}})
    verdict = judge("induction", facts)  # its strongest feeder is not a previous-token head
    assert verdict["status"] == "partial" and verdict["text"] == "supported by pattern and cause"
    facts.flagged["previous_token"].add((1, 3))
    assert judge("induction", facts)["status"] == "confirmed"
    facts.delta = 0.0
    assert judge("induction", facts)["text"] == "supported by pattern and weights"
    assert judge("sink", HeadFacts(0, 1, {"sink"}))["status"] == "unchecked"  # nothing else measured


@pytest.mark.slow
def test_cli(tmp_path, capsys, monkeypatch):
    html, data = tmp_path / "atlas.html", tmp_path / "atlas.json"
    args = ["atlas", "--model", "tests/planted.py:planted_lm", "--seq-len", "32", "--num-seqs", "2", "--repeat-len",
            "10", "--fast", "--html", str(html), "--json", str(data)]
    code, out, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    payload = json.loads(data.read_text())
    assert payload["settings"]["fast"] is True and any(e["effects"]["estimated"] for e in payload["heads"])
    ablation = next(stage for stage in payload["stages"] if stage["name"] == "ablation")
    assert ablation["note"].startswith("estimated")  # --fast: the estimate, marked as such
    assert "provenance" in payload and "<b>estimated</b>" in html.read_text() and "induction" in out
    code, _, err = run_cli(args, capsys, monkeypatch)  # outputs exist: refused without --force, before any work
    assert code == 2 and err.startswith("error: ") and "--force" in err
    code, _, err = run_cli(["atlas", "--model", "tests/planted.py:planted_lm", "--resume"], capsys,
                           monkeypatch)
    assert code == 2
    assert err.strip() == "error: --resume continues the sweeps kept in a --results folder: give --results"


def test_notebook_fragment(built):
    fragment = built._repr_html_()
    assert fragment.startswith("<style>") and "<html" not in fragment and 'data-kind="atlas"' in fragment
    assert repr(built) == "Atlas('planted': 2x4 heads, 4 labels, 2 confirmed, 2 pattern only)"


@pytest.mark.slow
@pytest.mark.browser
def test_notebook_fragment_draws_the_head_finder(built, tmp_path, open_page):  # noqa: F811
    path = tmp_path / "notebook.html"  # a notebook's output: the fragment in a page, carrying plotly.js itself
    path.write_text(f"<!DOCTYPE html><html><head><meta charset='utf-8'></head><body>{built._repr_html_()}</body>"
                    "</html>", encoding="utf-8")
    opened = open_page(path)
    assert len(_rows(opened)) == 8
    opened.page.click("tr.atlas-row[data-head='0.1']")
    opened.wait_ready(dashboard="0.1")
    assert "pattern only" in opened.page.text_content(".atlas-dashboard")
    opened.check_clean()


def _rows(opened) -> list[str]:
    return opened.page.evaluate("Array.from(document.querySelectorAll('tr.atlas-row')).map(r => r.dataset.head)")


@pytest.mark.slow
@pytest.mark.browser
def test_page_in_chromium(built, tmp_path, open_page):  # noqa: F811
    payload = built.to_dict()
    payload["model"] = SCRIPT
    induction = payload["heads"][5]
    induction["examples"][0]["spans"][-1]["tokens"][0] = SCRIPT + IMG  # text in a dashboard stays text
    induction["classes"][0]["evidence"]["kinds"]["weights"]["why"] = IMG
    path = tmp_path / "atlas.html"
    blocks = {name: p.page_payload() for name, p in built.patterns.items()}
    path.write_text(atlas_page(payload, blocks), encoding="utf-8")
    opened = open_page(path)
    assert opened.page.text_content("h1") == f"Atlas of {SCRIPT}"
    assert len(_rows(opened)) == 8 and opened.page.locator(".atlas-dashboard").is_hidden()

    opened.page.select_option(".atlas-x", "induction_score")  # the head finder's axes change
    opened.wait_ready(x="induction_score")
    drawn = opened.page.evaluate("document.querySelector('.atlas-scatter').data[0]")
    expected = [entry["metrics"]["induction_score"] for entry in payload["heads"]]
    assert [drawn["x"][drawn["customdata"].index(i)] for i in range(8)] == expected
    opened.page.select_option(".atlas-y", "headvis_pattern_entropy")  # HeadVis's metrics are axes too
    opened.wait_ready(y="headvis_pattern_entropy")
    drawn = opened.page.evaluate("document.querySelector('.atlas-scatter').data[0]")
    expected = [entry["metrics"]["headvis_pattern_entropy"] for entry in payload["heads"]]
    assert [drawn["y"][drawn["customdata"].index(i)] for i in range(8)] == expected
    assert "induction score" in opened.page.evaluate(
        "document.querySelector('.atlas-scatter').layout.xaxis.title.text")

    opened.page.click("th[data-column='second_repeat_delta']")  # sort: largest first
    deltas = {f"{e['layer']}.{e['head']}": e["metrics"]["second_repeat_delta"] for e in payload["heads"]}
    assert _rows(opened)[:2] == sorted((h for h in deltas if deltas[h] is not None), key=lambda h: -deltas[h])
    opened.page.fill(".atlas-search", "induction")  # search
    opened.wait_ready(shown="1")
    assert _rows(opened) == ["1.1"]
    opened.page.fill(".atlas-search", "")
    opened.page.select_option(".atlas-evidence", "pattern_only")  # the filter by evidence
    opened.wait_ready(shown="1")
    assert _rows(opened) == ["0.1"]
    opened.page.select_option(".atlas-evidence", "all")
    opened.wait_ready(shown="8")

    opened.page.click("tr.atlas-row[data-head='1.1']")  # a click opens the dashboard
    opened.wait_ready(dashboard="1.1")
    text = opened.page.text_content(".atlas-dashboard")
    assert "confirmed by pattern, weights and cause" in text and SCRIPT + IMG in text and IMG in text
    assert_pattern(opened.z(".atlas-pattern"), built.patterns["repeated"].weights(1, 1))
    screenshot(opened, "atlas_planted.png")
    for layer, head in [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 2), (1, 3)]:  # every dashboard, from the plots
        target = ".atlas-scatter" if head % 2 else ".atlas-grid"
        opened.page.evaluate(f"document.querySelector('{target}').emit('plotly_click', "
                             f"{{points: [{{customdata: {layer * 4 + head}}}]}})")
        opened.wait_ready(dashboard=f"{layer}.{head}")
    opened.check_clean()  # no console error, no request but the page, no dialog, no injected element


def test_task_and_dla_on_a_tiny_llama_with_smollm2s_tokenizer(smollm2):
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=smollm2.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = tf.LlamaForCausalLM(config).eval()
    loaded = LoadedModel(model=model, tokenizer=smollm2.tokenizer, name="tiny-llama", vocab_size=smollm2.vocab_size)
    built = atlas(loaded, fast=True, task="sva", task_count=4, seq_len=16, num_seqs=2, repeat_len=8)
    task = next(stage for stage in built.stages if stage.name == "task")
    assert task.note.startswith("exact")  # --fast: the task sweep stays exact
    natural = natural_set(loaded, seq_len=16, num_seqs=2)
    dla = next_token_attribution(loaded, natural.input_ids, natural.attention_mask)
    alone = sweep(loaded, build_probe_set("task", loaded, ProbeOptions(task="sva", num_seqs=4, seq_len=16,
                                                                        repeat_len=8)))
    for result in alone.heads:
        entry = built.head(result.layer, result.head)
        assert entry["metrics"]["task_delta"] == pytest.approx(result.delta, abs=1e-6)
        assert entry["metrics"]["dla"] == pytest.approx(float(dla.per_head[result.layer, result.head]), abs=1e-6)
    assert all(entry["writes"] is not None and entry["examples"] for entry in built.heads)

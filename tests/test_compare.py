"""Head maps and `probe compare`: each format read from a small file in its own convention (query heads, KV heads),
the explicit conversions between them and the refusal without one, probe's own writers read back, the statistics
against an independent computation (pandas), bad input in one line, and the page in a headless Chromium."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import run_cli
from test_browser import browser, open_page  # noqa: F401  (the fixtures)
from test_html import IMG

from probe.errors import ProbeError
from probe.headmaps import KV, QUERY, HeadMap, compare, read_map, write_map

TESTS = Path(__file__).parent
PLANTED = f"{TESTS / 'planted.py'}:planted_textbook"


def _duo(folder: Path, values: np.ndarray, threshold: float | None = None) -> Path:
    """A DuoAttention folder as mit-han-lab/duo-attention's attn_patterns/ hold them (18-digit exponent form)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "full_attention_heads.tsv").write_text(
        "".join("\t".join(f"{value:.18e}" for value in row) + "\n" for row in values), encoding="utf-8")
    config = {"sink_size": 128, "recent_size": 256, **({"threshold": threshold} if threshold is not None else {})}
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def _query_map(rng: np.random.Generator, layers: int = 3, heads: int = 8) -> np.ndarray:
    return np.round(rng.random((layers, heads)), 3)


def test_a_query_head_map_against_a_kv_head_map_needs_an_explicit_conversion(tmp_path: Path) -> None:
    query = _query_map(np.random.default_rng(0))  # 3 layers x 8 query heads, 2 KV heads of 4 query heads each
    np.save(tmp_path / "q.npy", query)
    kv = np.random.default_rng(1).random((3, 2))
    _duo(tmp_path / "duo", kv)
    a, b = read_map(tmp_path / "q.npy"), read_map(tmp_path / "duo")
    assert (a.convention, a.columns, b.convention, b.columns) == (QUERY, 8, KV, 2)
    with pytest.raises(ProbeError, match="3 layers x 8 query heads, B 3 layers x 2 KV heads: pass group"):
        compare(a, b)
    for group, reduce in (("max", np.max), ("min", np.min), ("mean", np.mean)):
        result = compare(a, b, group=group)
        expected = reduce(query.reshape(3, 2, 4), axis=2)  # query head q reads KV head q // 4 (repeat_kv)
        np.testing.assert_allclose(result.a.values, expected)
        np.testing.assert_allclose(result.difference, kv - expected)
        assert result.to_dict()["convention"] == "kv" and "4 query heads" in result.conversion
    expanded = compare(b, a, expand=True)  # the KV map is A here: it is expanded where it stands
    np.testing.assert_allclose(expanded.a.values, np.repeat(kv, 4, axis=1))
    np.testing.assert_allclose(expanded.b.values, query)
    assert expanded.a.labels is not None and expanded.a.labels.shape == (3, 8)


def test_grouping_refuses_counts_that_do_not_divide_and_maps_of_other_layers(tmp_path: Path) -> None:
    np.save(tmp_path / "q.npy", np.ones((3, 8)))
    _duo(tmp_path / "three", np.ones((3, 3)))
    _duo(tmp_path / "layers", np.ones((4, 2)))
    with pytest.raises(ProbeError, match="8 query heads per layer, which 3 KV heads do not divide"):
        compare(read_map(tmp_path / "q.npy"), read_map(tmp_path / "three"), group="max")
    with pytest.raises(ProbeError, match="A has 3 layers, B 4"):
        compare(read_map(tmp_path / "q.npy"), read_map(tmp_path / "layers"), group="max")
    np.save(tmp_path / "narrow.npy", np.ones((3, 4)))
    with pytest.raises(ProbeError, match="maps of different shapes"):  # two query maps: no grouping applies
        compare(read_map(tmp_path / "q.npy"), read_map(tmp_path / "narrow.npy"), group="max")


def test_statistics_match_an_independent_computation(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    a = np.round(rng.random((4, 6)), 1)  # one decimal: many ties, Spearman's average ranks matter
    b = np.round(a + rng.normal(0, 0.3, a.shape), 1)
    a[2, 3] = np.nan  # a head one map lacks is left out of every statistic
    maps = [HeadMap(values, QUERY, name, "tensor", "value") for name, values in (("a", a), ("b", b))]
    result = compare(*maps, top_k=5, same_kind=True).to_dict()  # two tensors: their files do not say
    frame = pd.DataFrame({"a": a.ravel(), "b": b.ravel()}).dropna()
    assert result["heads"] == 23
    assert result["spearman"] == pytest.approx(frame.corr(method="spearman").loc["a", "b"], abs=1e-12)
    by_hand = np.corrcoef(frame["a"].rank(method="average"), frame["b"].rank(method="average"))[0, 1]
    assert result["spearman"] == pytest.approx(by_hand, abs=1e-12)
    assert result["pearson"] == pytest.approx(frame.corr().loc["a", "b"], abs=1e-12)
    assert result["mean_abs_difference"] == pytest.approx((frame["b"] - frame["a"]).abs().mean())
    heads = [(layer, head) for layer in range(4) for head in range(6) if not np.isnan(a[layer, head])]
    tops = [set(sorted(heads, key=lambda cell: (-values[cell], cell))[:5]) for values in (a, b)]
    assert result["top_k"]["count"] == len(tops[0] & tops[1])
    assert result["top_k"]["jaccard"] == pytest.approx(len(tops[0] & tops[1]) / len(tops[0] | tops[1]))
    assert {tuple(cell) for cell in result["top_k"]["only_a"]} == tops[0] - tops[1]
    moved = max(heads, key=lambda cell: abs(b[cell] - a[cell]))
    assert abs(result["movers"][0]["difference"]) == pytest.approx(abs(b[moved] - a[moved]))
    frame_of = compare(*maps, same_kind=True).to_frame()  # pandas: one row per head, named apart from numbers
    assert len(frame_of) == 24 and frame_of["name"][0] == "L0H0" and frame_of["difference"].isna().sum() == 1
    labelled = compare(*maps, threshold=(0.5, 0.7)).to_dict()["labelled"]
    above = [{cell for cell in heads if values[cell] > cut} for values, cut in ((a, 0.5), (b, 0.7))]
    assert (labelled["count_a"], labelled["count_b"], labelled["count"]) == (len(above[0]), len(above[1]),
                                                                             len(above[0] & above[1]))


def test_each_format_is_read_in_its_own_convention(tmp_path: Path) -> None:
    query = _query_map(np.random.default_rng(4), 2, 4)
    scores = {f"{layer}-{head}": [float(query[layer, head]), 0.0] for layer in range(2) for head in range(4)}
    (tmp_path / "llama.json").write_text(json.dumps(scores))  # Retrieval_Head's head_score/*.json
    retrieval = read_map(tmp_path / "llama.json")
    assert (retrieval.format, retrieval.convention) == ("retrieval-head", QUERY)
    np.testing.assert_allclose(retrieval.values, query / 2)  # the mean of each head's list
    torch.save(torch.tensor(query, dtype=torch.bfloat16), tmp_path / "detector.pt")  # TransformerLens' head_detector
    np.testing.assert_allclose(read_map(tmp_path / "detector.pt").values, query, atol=4e-3)
    np.savetxt(tmp_path / "map.csv", query, delimiter=",")
    np.testing.assert_allclose(read_map(tmp_path / "map.csv").values, query)
    duo = read_map(_duo(tmp_path / "duo", query[:, :2], threshold=0.4) / "full_attention_heads.tsv")
    assert (duo.format, duo.convention, duo.threshold) == ("duo", KV, 0.4)
    assert (duo.labels == (query[:, :2] > 0.4)).all()
    torch.save({"previous_token": torch.zeros(2, 4), "induction": torch.ones(2, 4)}, tmp_path / "several.pt")
    with pytest.raises(ProbeError, match="holds several scores: choose one with score \\(previous_token, induction"):
        read_map(tmp_path / "several.pt")
    assert read_map(tmp_path / "several.pt", "induction").values.sum() == 8
    with pytest.raises(ProbeError, match="nothing called 'sink': choose score from previous_token, induction"):
        read_map(tmp_path / "several.pt", "sink")


@pytest.mark.parametrize("name, format", [("w.npy", "tensor"), ("w.pt", "tensor"), ("w.tsv", "tensor"),
                                          ("h.json", "retrieval-head"), ("maps", "duo")])
def test_written_maps_read_back(tmp_path: Path, name: str, format: str) -> None:
    values = _query_map(np.random.default_rng(5), 2, 4)
    head_map = HeadMap(values, KV if format == "duo" else QUERY, "made", "tensor", "value", n_heads=4)
    back = read_map(write_map(head_map, tmp_path / name, format))
    assert back.format == format and back.convention == head_map.convention
    np.testing.assert_allclose(back.values, values, rtol=1e-6)


def test_text_maps_read_back_the_same_float64(tmp_path: Path) -> None:
    """DuoAttention's TSV (`.18e`) and Retrieval_Head's JSON (repr) hold every float64 exactly; DuoAttention's
    settings go into its config.json, a format without a settings file refuses them."""
    values = np.random.default_rng(7).random((3, 4)) / 3  # 17 significant digits each
    folder = write_map(HeadMap(values, KV, "made", "duo", "full_attention"), tmp_path / "duo", "duo",
                       settings={"sink_size": 4, "recent_size": 8})
    np.testing.assert_array_equal(read_map(folder).values, values)
    assert json.loads((folder / "config.json").read_text()) == {"sink_size": 4, "recent_size": 8, "threshold": 0.5}
    assert np.loadtxt(folder / "full_attention_heads.tsv", delimiter="\t").tolist() == values.tolist()
    scores = HeadMap(values, QUERY, "made", "tensor", "retrieval")
    np.testing.assert_array_equal(read_map(write_map(scores, tmp_path / "h.json", "retrieval-head")).values, values)
    with pytest.raises(ProbeError, match="format 'retrieval-head' has no settings file"):
        write_map(scores, tmp_path / "other.json", "retrieval-head", settings={"sink_size": 4})
    assert sorted(path.name for path in tmp_path.iterdir()) == ["duo", "h.json"]  # no temporary file left


def test_probes_own_files_read_back(tmp_path: Path, capsys, monkeypatch) -> None:
    code, _, err = run_cli(["kv-heads", "--model", PLANTED, "--lengths", "120", "--depths", "0.5", "--sink", "1",
                            "--recent", "4", "--no-curve", "--full-fraction", "0.25",
                            "--export", f"duo:{tmp_path / 'duo'}", "--export", f"headkv:{tmp_path / 'headkv.json'}",
                            "--json", str(tmp_path / "kv.json")],
                           capsys, monkeypatch)
    assert code == 0, err
    payload = json.loads((tmp_path / "kv.json").read_text())
    retrieval = read_map(tmp_path / "kv.json", "retrieval")
    for row in payload["heads"]:
        assert retrieval.values[row["layer"], row["head"]] == row["retrieval"]
    headkv = read_map(tmp_path / "headkv.json")  # --export headkv: is Retrieval_Head's format
    np.testing.assert_array_equal(headkv.values, retrieval.values)
    duo, inside = read_map(tmp_path / "duo"), read_map(tmp_path / "kv.json", "duo")
    np.testing.assert_array_equal(duo.values, inside.values)  # the same float64: one writer, `.18e`
    full = {(row["layer"], row["kv_head"]) for row in payload["kv_heads"] if row["label"] == "full"}
    assert {tuple(cell) for cell in np.argwhere(duo.labels).tolist()} == full
    against = compare(retrieval, duo, group="max").to_dict()  # retrieval per query head against the exported gates
    assert against["labelled"] is None and against["convention"] == "kv"
    code, out, err = run_cli(["compare", str(tmp_path / "kv.json"), str(tmp_path / "duo"), "--score", "retrieval",
                              "--expand"], capsys, monkeypatch)  # once: for the map of several, the TSV has one
    assert code == 0 and "score retrieval" in out and "score full_attention" in out, err
    kv_retrieval = read_map(tmp_path / "kv.json", "kv_retrieval")  # the KV head's retrieval: max over its group
    np.testing.assert_allclose(compare(retrieval, kv_retrieval, group="max").difference, 0.0)
    code, _, err = run_cli(["classify", "--model", PLANTED, "--json", str(tmp_path / "classify.json")], capsys,
                           monkeypatch)
    assert code == 0, err
    classified = json.loads((tmp_path / "classify.json").read_text())
    induction = read_map(tmp_path / "classify.json", "induction")
    flagged = {(row["layer"], row["head"]) for row in classified["flagged"]["induction"]}
    assert {tuple(cell) for cell in np.argwhere(induction.labels).tolist()} == flagged and flagged
    assert induction.dtype == classified["dtype"] and induction.threshold == classified["thresholds"]["induction"]
    for row in classified["heads"]:
        assert induction.values[row["layer"], row["head"]] == row["scores"]["induction"]


def test_the_command_writes_json_csv_and_html(tmp_path: Path, capsys, monkeypatch) -> None:
    rng = np.random.default_rng(6)
    np.save(tmp_path / "a.npy", _query_map(rng))
    _duo(tmp_path / "duo", rng.random((3, 2)))
    outputs = ["--json", str(tmp_path / "c.json"), "--csv", str(tmp_path / "c.csv"), "--html", str(tmp_path / "c.html")]
    code, out, err = run_cli(["compare", str(tmp_path / "a.npy"), str(tmp_path / "duo"), "--group", "mean",
                              "--top", "3", "--threshold", "0.5", "--same-kind", *outputs], capsys, monkeypatch)
    assert code == 0, err
    payload = json.loads((tmp_path / "c.json").read_text())
    assert payload["top_k"]["k"] == 3 and payload["conversion"].startswith("query heads -> KV heads: the mean")
    above = [{(row["layer"], row["head"]) for row in payload["rows"] if row[side] > 0.5} for side in ("a", "b")]
    assert payload["labelled"]["count"] == len(above[0] & above[1]) and payload["labelled"]["a"] == "value > 0.5"
    assert "Spearman" in out and "2 KV heads" in out and payload["provenance"]["maps"][1] == str(tmp_path / "duo")
    rows = pd.read_csv(tmp_path / "c.csv")
    assert list(rows["name"][:2]) == ["L0KV0", "L0KV1"] and len(rows) == 6
    np.testing.assert_allclose(rows["difference"], rows["b"] - rows["a"], atol=2e-6)
    assert "B - A" in (tmp_path / "c.html").read_text()


@pytest.mark.parametrize("args, expected", [
    (["missing.json", "a.npy"], "missing.json does not exist"),
    (["notes.txt", "a.npy"], "notes.txt is no head map probe reads: formats duo, probe-classify"),
    (["a.npy", "duo"], "pass --group (max, min or mean: query heads -> KV heads) or --expand"),
    (["a.npy", "duo", "--group", "median"], "--group 'median': use one of max, min, mean"),
    (["a.npy", "layers.npy"], "A has 3 layers, B 5"),
    (["several.pt", "a.npy"], "holds several scores: choose one with --score (previous_token, induction)"),
    (["several.pt", "a.npy", "--score", "sink"], "called 'sink': choose --score from previous_token, induction"),
    (["a.npy", "a.npy", "--score", "x", "--score", "y", "--score", "z"], "--score is given 3 times"),
    (["bad.json", "a.npy"], "no head map probe reads"),
    (["a.npy", "a.npy", "--top", "0"], "--top must be at least 1"),
])
def test_bad_input_is_one_line(args: list[str], expected: str, tmp_path: Path, capsys, monkeypatch) -> None:
    np.save(tmp_path / "a.npy", np.ones((3, 8)))
    np.save(tmp_path / "layers.npy", np.ones((5, 8)))
    _duo(tmp_path / "duo", np.ones((3, 2)))
    torch.save({"previous_token": torch.zeros(3, 8), "induction": torch.ones(3, 8)}, tmp_path / "several.pt")
    (tmp_path / "notes.txt").write_text("not a map")
    (tmp_path / "bad.json").write_text("{not json")
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(["compare", *args], capsys, monkeypatch)
    assert code == 2 and err.count("\n") == 1 and expected in err, err
    assert "Traceback" not in err


def test_a_malformed_probe_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "classify.json").write_text(json.dumps({"heads": [{"layer": 0}], "classes": {}, "thresholds": {}}))
    with pytest.raises(ProbeError, match="looks like a probe-classify file but is malformed"):
        read_map(tmp_path / "classify.json")


@pytest.mark.slow
def test_the_page_draws_a_b_and_the_difference(tmp_path: Path, open_page) -> None:  # noqa: F811
    from test_browser import screenshot

    from probe.reports.compare import compare_page

    rng = np.random.default_rng(7)
    source = tmp_path / f"{IMG}.npy"  # a file name is text the page shows: escaped
    np.save(source, _query_map(rng))
    payload = compare(read_map(source), read_map(_duo(tmp_path / "duo", rng.random((3, 2)))), expand=True,
                      same_kind=True).to_dict()
    path = tmp_path / "compare.html"
    path.write_text(compare_page(payload), encoding="utf-8")
    opened = open_page(path)
    assert IMG in opened.page.text_content("h1")
    for name, key in (("a", "a"), ("b", "b"), ("third", "difference")):
        z = opened.z(f".probe-compare-{name}")
        for row in payload["rows"]:
            assert z[row["layer"]][row["head"]] == row[key]
    listed = opened.page.evaluate("[...document.querySelectorAll('.probe-movers tr')].length")
    assert listed == 1 + min(15, payload["heads"])
    screenshot(opened, "compare.png")
    opened.check_clean()


def test_scores_against_ablation_deltas_are_compared_by_rank_each_map_on_its_own_scale(
        tmp_path: Path, capsys, monkeypatch, open_page) -> None:  # noqa: F811
    """An attention share minus a loss change means nothing: classify's scores against ablate's deltas give ranks,
    no B - A (the page says so), each map drawn on its own colour scale with its unit, the signed deltas centred
    on 0; two maps of one kind of score do get B - A."""
    small = ["--model", PLANTED, "--num-seqs", "2", "--repeat-len", "8"]
    for args in (["classify", *small, "--seq-len", "24"], ["ablate", *small, "--data", "repeated"]):
        code, _, err = run_cli([*args, "--json", str(tmp_path / f"{args[0]}.json")], capsys, monkeypatch)
        assert code == 0, err
    scores, deltas = read_map(tmp_path / "classify.json", "induction"), read_map(tmp_path / "ablate.json", "delta")
    assert scores.quantity == "induction score" and "ablated" in (deltas.quantity or "") and deltas.signed
    payload = compare(scores, deltas).to_dict()
    assert payload["measure"] == "ranks" and payload["mean_abs_difference"] is None
    assert all(row["difference"] is None for row in payload["rows"])
    assert all(row["rank_difference"] == row["rank_b"] - row["rank_a"] for row in payload["rows"])
    assert [abs(row["rank_difference"]) for row in payload["movers"]] == sorted(
        (abs(row["rank_difference"]) for row in payload["rows"]), reverse=True)[:len(payload["movers"])]
    assert compare(scores, scores).to_dict()["measure"] == "difference"  # one kind: B - A
    with pytest.raises(ProbeError, match="different kinds of score"):
        compare(scores, deltas, same_kind=True)
    html = tmp_path / "c.html"
    code, out, err = run_cli(["compare", str(tmp_path / "classify.json"), str(tmp_path / "ablate.json"), "--score",
                              "induction", "--score", "delta", "--html", str(html)], capsys, monkeypatch)
    assert code == 0 and "compared by rank" in out and "mean |B - A|" not in out, out
    header = " ".join(out.split("Largest differences")[1].splitlines()[1].split())
    assert header.endswith("rank A rank B rank B - rank A"), header  # ranked by rank, and no B - A column
    opened = open_page(html)
    assert "not one kind of score, so no B - A" in opened.page.text_content(".probe-page")
    traces = {name: opened.page.evaluate(f"(() => {{ const t = document.querySelector('.probe-compare-{name}')"
                                         ".data[0]; return [t.zmin, t.zmax, t.zmid, t.colorbar.title.text]; })()")
              for name in ("a", "b", "third")}
    values = {"a": scores.values, "b": deltas.values}
    assert traces["a"][:2] == pytest.approx([np.nanmin(values["a"]), np.nanmax(values["a"])])  # its own range
    reach = np.nanmax(np.abs(values["b"]))
    assert traces["b"][:3] == pytest.approx([-reach, reach, 0])  # signed: centred on 0, a negative is no zero
    assert "score, 0 to 1" in traces["a"][3] and "cross_entropy change" in traces["b"][3]
    assert traces["third"][2] == 0 and "rank" in traces["third"][3]
    z = opened.z(".probe-compare-third")
    for row in payload["rows"]:
        assert z[row["layer"]][row["head"]] == row["rank_difference"]
    opened.check_clean()

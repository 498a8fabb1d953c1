"""Steering through single heads: scale as an ablation method, the target_words metric, `probe.steering` and `probe
steer`, each against a hand computation that scales a head's slice of the output projection's input."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hypothesis import given
from hypothesis import strategies as st

from conftest import run_cli, tiny_loaded
from fuzzing import MISSING_MODEL, argument, cli_outcome, file_bytes, inputs, valid_or_refused, write
from probe.ablation import ablate, sweep
from probe.ablation.methods import METHODS, ScaleAblation, build_method
from probe.ablation.metrics import METRICS, TargetWords, read_target_words, target_words
from probe.ablation.sweep import baseline_metric
from probe.errors import ProbeError
from probe.hooks.run import logits_of, run_model
from probe.hooks.types import HookContext
from probe.inputs import ProbeOptions, ProbeSet, build_probe_set, contrast_task, logit_diffs, repeated_set
from probe.models import LoadedModel, load_model
from probe.patching.runs import contrast_runs
from probe.reports.steer import steer_page
from probe.cli.steer import parse_values
from probe.steering import find_heads, generations, greedy, steer, steer_curves
from test_browser import browser, open_page  # noqa: F401 (fixtures)
from test_cli import strict_json
from test_distributed import MODEL, alone, comparable, torchrun
from test_html import IMG, SCRIPT

WORDS = "tests/words.py:tiny_with_words"
HEAD_DIM = 16  # tiny llama: hidden 64, 4 heads


@contextmanager
def scaled_projection(model: torch.nn.Module, layer: int, head: int, alpha: float, head_dim: int) -> Iterator[None]:
    """By hand: the head's slice of the output projection's input multiplied by alpha."""
    def hook(module: torch.nn.Module, args: tuple) -> tuple:
        z = args[0].clone()
        z[..., head * head_dim:(head + 1) * head_dim] *= alpha
        return (z,)

    handle = model.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def cross_entropy(model: torch.nn.Module, ids: torch.Tensor) -> float:
    with torch.no_grad():
        logits = logits_of(run_model(model, ids))
    return float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).double(), ids[:, 1:].reshape(-1)))


def test_the_curve_equals_scaling_the_projection_by_hand(tiny_llama: LoadedModel) -> None:
    probe_set = repeated_set(tiny_llama, repeat_len=6, num_seqs=3, seed=1)
    heads, alphas = [(0, 1), (1, 3)], [0.0, 0.5, 2.0, 3.0]
    result = steer_curves(tiny_llama, probe_set, heads, alphas, batch_size=2)
    assert result.values == [0.0, 0.5, 1.0, 2.0, 3.0]  # ascending, alpha 1 (the model as it is) added
    base = cross_entropy(tiny_llama.model, probe_set.input_ids)
    assert result.baseline == pytest.approx(base, abs=1e-5)
    for curve in result.curves:
        for point in curve["points"]:
            with scaled_projection(tiny_llama.model, curve["layer"], curve["head"], point["setting"], HEAD_DIM):
                hand = cross_entropy(tiny_llama.model, probe_set.input_ids)
            assert point["value"] == pytest.approx(hand, abs=1e-5), (curve["layer"], curve["head"], point["setting"])
            assert point["delta"] == pytest.approx(hand - base, abs=1e-5)
    assert result.curves[1]["points"][0]["value"] != pytest.approx(base, abs=1e-4)  # the head does something


def test_scale_zero_is_zero_ablation_exactly(tiny_llama: LoadedModel) -> None:
    probe_set = repeated_set(tiny_llama, repeat_len=5, num_seqs=2, seed=0)
    scaled = sweep(tiny_llama, probe_set, method=ScaleAblation(0.0))
    zeroed = sweep(tiny_llama, probe_set, method="zero")
    assert [(r.heads, r.loss) for r in scaled.results] == [(r.heads, r.loss) for r in zeroed.results]
    ids = probe_set.input_ids
    with torch.no_grad():
        with steer(tiny_llama, {"1.2": 0.0, (0, 3): 0.0}):
            steered = logits_of(run_model(tiny_llama.model, ids))
        with ablate(tiny_llama.model, [(1, 2), (0, 3)]):
            ablated = logits_of(run_model(tiny_llama.model, ids))
    assert torch.equal(steered, ablated)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_scaling_keeps_the_dtype_and_zero_equals_zero_ablation(dtype: torch.dtype) -> None:
    model = tiny_loaded("llama_gqa").model.to(dtype)
    loaded = LoadedModel(model=model, tokenizer=None, name="tiny-half", vocab_size=120)
    probe_set = repeated_set(loaded, repeat_len=5, num_seqs=2, seed=0)
    scaled = sweep(loaded, probe_set, method=ScaleAblation(0.0))
    zeroed = sweep(loaded, probe_set, method="zero")
    assert [r.loss for r in scaled.results] == [r.loss for r in zeroed.results]
    result = steer_curves(loaded, probe_set, [(1, 2)], [0.0, 3.0])
    assert result.dtype == str(dtype).removeprefix("torch.") and len(result.curves[0]["points"]) == 3
    heads = torch.randn(2, 3, 4, 16, dtype=dtype)
    assert ScaleAblation(2.0).replacement(heads, HookContext(0, "z")).dtype == dtype


def test_scale_is_a_registered_method_built_with_its_alpha() -> None:
    assert METHODS["scale"] is ScaleAblation
    built = build_method("scale", None, None, value=2.5)  # type: ignore[arg-type]  # needs no statistics
    assert isinstance(built, ScaleAblation) and built.alpha == 2.5
    assert build_method("scale", None, None).alpha == 0.0  # type: ignore[arg-type, attr-defined]
    with pytest.raises(ProbeError, match="finite"):
        ScaleAblation(float("nan"))


def test_find_ranks_every_head_as_a_hand_loop_does(tiny_llama: LoadedModel) -> None:
    probe_set = repeated_set(tiny_llama, repeat_len=6, num_seqs=2, seed=3)
    result = find_heads(tiny_llama, probe_set, 2.5, batch_size=2)
    base = cross_entropy(tiny_llama.model, probe_set.input_ids)
    hand = {}
    for layer in range(2):
        for head in range(4):
            with scaled_projection(tiny_llama.model, layer, head, 2.5, HEAD_DIM):
                hand[(layer, head)] = cross_entropy(tiny_llama.model, probe_set.input_ids) - base
    ranked = result.find["ranking"]  # type: ignore[index]
    assert [(e["layer"], e["head"]) for e in ranked] == sorted(hand, key=lambda key: -abs(hand[key]))
    for entry in ranked:
        assert entry["delta"] == pytest.approx(hand[(entry["layer"], entry["head"])], abs=1e-5)


def words_loaded() -> LoadedModel:
    return load_model(WORDS)


def test_target_words_metric_by_hand(tmp_path: Path) -> None:
    loaded = words_loaded()
    path = tmp_path / "words.txt"
    path.write_text("# cabinet words\nkeys\n\ncabinet\nkeys\n", encoding="utf-8")
    metric = target_words(loaded, path)
    tokens = [loaded.tokenizer.convert_tokens_to_ids(word) for word in ("keys", "cabinet")]
    assert metric.tokens == tuple(tokens) and metric.words == ("keys", "cabinet", "keys")
    ids = torch.tensor([loaded.tokenizer("the keys to the cabinet are here")["input_ids"],
                        loaded.tokenizer("the author near the guards is tired")["input_ids"]])
    probe_set = ProbeSet("natural", "two sentences", ids, 1)
    value, _ = baseline_metric(loaded, probe_set, metric=metric)
    with torch.no_grad():
        probs = logits_of(run_model(loaded.model, ids)).double().softmax(-1)
    assert value == pytest.approx(float(probs[:, :-1, tokens].sum(-1).mean()), abs=1e-6)
    other = target_words(loaded, _write(tmp_path / "other.txt", "guards\n"))
    assert metric.name.startswith("target_words:") and other.name != metric.name  # resume tells them apart


def _write(path: Path, text: str | bytes) -> Path:
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(("content", "message"), [
    ("", "is empty"), ("# only a comment\n\n", "has no word"), (b"\xff\xfe time\n", "not UTF-8"),
    ("keys\nzyzzyva\n", "not in"),
])
def test_a_bad_words_file_is_one_line(tmp_path: Path, content: str | bytes, message: str) -> None:
    path = _write(tmp_path / "words.txt", content)
    with pytest.raises(ProbeError, match=message) as caught:
        target_words(words_loaded(), path)
    assert "\n" not in str(caught.value) and caught.value.parameter == "target_words"
    with pytest.raises(ProbeError, match="not found"):
        read_target_words(tmp_path / "missing.txt")


def test_the_registered_target_words_metric_asks_for_the_words(tiny_llama: LoadedModel) -> None:
    assert isinstance(METRICS["target_words"], TargetWords)
    probe_set = repeated_set(tiny_llama, repeat_len=4, num_seqs=1)
    with pytest.raises(ProbeError, match="made from a file of one word"):
        baseline_metric(tiny_llama, probe_set, metric="target_words")


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def test_generate_restores_the_model_and_steers_model_generate() -> None:
    loaded = words_loaded()
    before, forward = _state(loaded.model), type(loaded.model.model.layers[0].self_attn).forward
    result = generations(loaded, "the keys to the", [(1, 2), (0, 1)], [0.0, 1.0, 4.0], max_new_tokens=6, seed=0)
    after = _state(loaded.model)
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert type(loaded.model.model.layers[0].self_attn).forward is forward
    assert not any(module._forward_hooks or module._forward_pre_hooks for module in loaded.model.modules())
    assert [row["text"] for row in result["rows"] if row["setting"] == 1.0] == [result["baseline"]] * 2
    assert len({row["text"] for row in result["rows"]}) > 1  # scaling changes what is generated
    ids = torch.tensor([loaded.tokenizer("the keys to the")["input_ids"]])
    with steer(loaded, {"1.2": 4.0}), torch.no_grad():  # around model.generate, as around any forward
        generated = loaded.model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        ours = greedy(loaded, ids, 6)
    assert generated[0, ids.shape[1]:].tolist() == ours[0]
    for row in result["rows"]:  # the batch, a row per head and alpha, gives what one generation at a time gives
        with steer(loaded, {(row["layer"], row["head"]): row["setting"]}):
            alone = greedy(loaded, ids, 6)[0]
        assert loaded.tokenizer.decode(alone) == row["text"], row
    with pytest.raises(RuntimeError), steer(loaded, {"0.1": 3.0}):
        raise RuntimeError("interrupted")
    assert all(torch.equal(before[name], value) for name, value in _state(loaded.model).items())
    assert not any(module._forward_hooks or module._forward_pre_hooks for module in loaded.model.modules())


def test_cli_curves_on_ioi_pairs_equal_the_library_and_the_page_escapes(tmp_path: Path, capsys, monkeypatch) -> None:
    out, page = tmp_path / "steer.json", tmp_path / "steer.html"
    code, stdout, stderr = run_cli(["steer", "--model", WORDS, "--heads", "1.2,0.1", "--alpha", "0,2",
                                    "--task", "ioi", "--num-seqs", "6", "--generate", "<b>the keys</b> & the",
                                    "--max-new-tokens", "4", "--json", str(out), "--html", str(page)],
                                   capsys, monkeypatch)
    assert code == 0, stderr
    payload = strict_json(out)
    assert payload["kind"] == "steer" and payload["dtype"] == "float32" and payload["metric"] == "logit_diff"
    assert payload["provenance"]["model"]["name"] == WORDS and payload["values"] == [0.0, 1.0, 2.0]
    assert payload["intervention"] == "scale" and payload["parameter"] == "alpha"
    loaded = words_loaded()
    clean = contrast_runs(loaded, contrast_task(loaded, "ioi", count=6, seed=0))[0]
    library = steer_curves(loaded, clean, [(1, 2), (0, 1)], [0.0, 2.0]).to_dict()
    for ours, theirs in zip(payload["curves"], library["curves"]):
        assert [p["value"] for p in ours["points"]] == pytest.approx([p["value"] for p in theirs["points"]],
                                                                     abs=1e-6)
        assert [p["figures"]["margin"] for p in ours["points"]] == pytest.approx(
            [p["value"] for p in ours["points"]], abs=1e-9)  # read forwards: the logit difference itself
        assert [p["delta"] for p in ours["points"]] == pytest.approx(
            [p["value"] - payload["baseline"] for p in ours["points"]], abs=1e-9)
    assert payload["measure"] == "logit difference" and payload["baseline"] == pytest.approx(
        payload["baseline_figures"]["margin"], abs=1e-9)
    first = stdout.splitlines()[0]
    assert first.startswith("Steering heads of") and "logit difference" in first and len(first) <= 100, first
    assert "higher = more of the behaviour" in stdout.split("alpha 2")[-1]  # in the footer, not the header
    assert "1.2" in stdout and "alpha 2" in stdout
    html = page.read_text(encoding="utf-8")
    assert "<b>the keys</b>" not in html and "&lt;b&gt;the keys&lt;/b&gt; &amp; the" in html
    assert "<unk>" not in html.split('type="application/json"')[0]  # decoded text reaches the page escaped
    assert 'id="probe-provenance"' in html and "probe-steer-curves" in html


def test_cli_find_with_target_words_streams_and_resumes(tmp_path: Path, capsys, monkeypatch) -> None:
    words = _write(tmp_path / "words.txt", "keys\ncabinet\n")
    text = _write(tmp_path / "text.txt", "the keys to the cabinet are here . the author near the guards is tired . "
                  * 6)
    results, out = tmp_path / "find.jsonl", tmp_path / "find.json"
    args = ["steer", "--model", WORDS, "--find", "--alpha", "3", "--target-words", str(words), "--data", str(text),
            "--seq-len", "16", "--num-seqs", "2", "--results", str(results), "--json", str(out),
            "--generate", "the keys to the", "--max-new-tokens", "3"]
    code, _, stderr = run_cli(args, capsys, monkeypatch)
    assert code == 0, stderr
    first = strict_json(out)
    assert results.is_file() and len(first["find"]["ranking"]) == 8 and first["metric"].startswith("target_words:")
    top = first["find"]["ranking"][0]
    assert [(row["layer"], row["head"], row["setting"]) for row in first["generations"]["rows"]] == [
        (top["layer"], top["head"], 3.0)]  # the top head, at the alpha it was found with
    loaded = words_loaded()
    probe_set = build_probe_set("natural", loaded, ProbeOptions(text, 16, 2))
    hand = find_heads(loaded, probe_set, 3.0, metric=target_words(loaded, words))
    assert [(e["layer"], e["head"]) for e in first["find"]["ranking"]] == [
        (e["layer"], e["head"]) for e in hand.find["ranking"]]  # type: ignore[index]
    code, _, stderr = run_cli([*args, "--resume", "--force"], capsys, monkeypatch)
    assert code == 0, stderr
    assert strict_json(out)["find"]["ranking"] == first["find"]["ranking"]


@pytest.mark.slow  # over 10 s on 2 cores
def test_find_under_torchrun_equals_one_process(tmp_path: Path) -> None:
    args = ["--model", MODEL, "--data", "repeated", "--num-seqs", "3", "--find", "--alpha", "2.5", "--stack", "1"]
    single = alone([*args, "--json", str(tmp_path / "one.json"), "--results", str(tmp_path / "one.jsonl")], tmp_path,
                   "steer")
    assert single.returncode == 0, single.stderr
    run = torchrun([*args, "--json", str(tmp_path / "two.json"), "--results", str(tmp_path / "two.jsonl")],
                   tmp_path, command_name="steer")
    assert run.returncode == 0, run.stderr
    one, two = comparable(tmp_path / "one.json", "steer"), comparable(tmp_path / "two.json", "steer")
    assert len(two["find"]["ranking"]) == 8 and two == one
    assert run.stdout.count("Steering heads of") == 1  # only rank 0 reports


@pytest.mark.parametrize(("extra", "message"), [
    (["--find", "--alpha", "0,3"], "one --values value"), (["--find", "--values", "0,3"], "one --values value"),
    (["--alpha", "1,x"], "numbers separated by commas"), (["--heads", "1.2", "--values", "1,x"], "--values '1,x'"),
    (["--heads", "1.2", "--alpha", "2", "--values", "3"], "give one of them"),
    (["--heads", "1.2", "--intervention", "zero"], "--intervention 'zero': use one of scale"),
    ([], "give --heads"), (["--heads", "1.2", "--alpha", "inf"], "finite"),
    (["--heads", "1.2", "--task", "ioi", "--target-words", "w.txt"], "give one of them"),
    (["--heads", "1.2", "--target-words", "missing.txt"], "not found"),
])
def test_bad_options_are_one_line_before_the_model_loads(extra: list[str], message: str, capsys,
                                                         monkeypatch) -> None:
    code, _, stderr = run_cli(["steer", "--model", "no/such-model", *extra], capsys, monkeypatch)
    assert code == 2 and message in stderr and len(stderr.strip().splitlines()) == 1


def test_the_page_draws_from_a_payload_and_refuses_another(tmp_path: Path) -> None:
    payload = {"model": "<m>", "dtype": "float32", "data": "<d>", "metric": "logit_diff", "metric_description": "x",
               "baseline": 1.0, "intervention": "scale", "parameter": "alpha", "values": [0.0, 1.0],
               "curves": [{"layer": 0, "head": 1, "points": [
                   {"setting": 0.0, "value": 0.5, "delta": -0.5, "figures": {}},
                   {"setting": 1.0, "value": 1.0, "delta": 0.0, "figures": {}}]}], "find": None, "generations": None}
    html = steer_page(payload)
    assert "&lt;m&gt;" in html and "<m>" not in html.replace("<meta", "")
    with pytest.raises(ProbeError, match="not a steering result"):
        steer_page({"model": "m"})


SCALES = ["0,0.5,2,3", "3", "-1,0,1", "1e-3,2.5", "0, 1 ,2"]
WORD_LINES = st.one_of(st.sampled_from(["time", "day", "# comment", "", "  week  ", "good morning"]),
                       st.text(max_size=8))


@given(text=inputs(SCALES))
def test_scales_parse_or_refuse(text: str) -> None:
    result = valid_or_refused(lambda: parse_values(text))
    if not isinstance(result, ProbeError):
        assert result and all(isinstance(alpha, float) and abs(alpha) < float("inf") for alpha in result)
        assert len(set(result)) == len(result)


@given(data=file_bytes(WORD_LINES))
def test_words_files_read_or_refuse(tmp_path: Path, data: bytes) -> None:
    result = valid_or_refused(lambda: read_target_words(write(tmp_path / "words.txt", data)))
    if not isinstance(result, ProbeError):
        assert result and all(word == word.strip() and word and not word.startswith("#") for word in result)


@given(text=inputs(SCALES), data=file_bytes(WORD_LINES))
def test_scales_and_words_on_the_command_line(tmp_path: Path, text: str, data: bytes, capsys, monkeypatch) -> None:
    words = write(tmp_path / "words.txt", data)
    code, err = cli_outcome(["steer", "--model", MISSING_MODEL, "--heads", "0.1", "--alpha", argument(text),
                             "--target-words", str(words)], capsys, monkeypatch)
    assert code == 2 and "error: " in err


@pytest.mark.slow
@pytest.mark.browser
def test_the_page_draws_a_curve_per_head_and_the_bars_in_a_browser(tmp_path: Path, open_page) -> None:  # noqa: F811
    points = [{"setting": a, "value": v, "delta": v - 1.0, "figures": {}}
              for a, v in ((0.0, 0.5), (1.0, 1.0), (3.0, 2.0))]
    payload = {"model": SCRIPT, "dtype": "float32", "data": IMG, "metric": "target_words", "metric_description": SCRIPT,
               "baseline": 1.0, "intervention": "scale", "parameter": "alpha", "values": [0.0, 1.0, 3.0],
               "layer_names": None,
               "curves": [{"layer": 0, "head": 1, "points": points}, {"layer": 1, "head": 2, "points": points[::-1]}],
               "find": {"setting": 3.0, "path": "exact", "ranking": [
                   {"layer": 1, "head": 2, "value": 2.0, "delta": 1.0, "figures": {}},
                   {"layer": 0, "head": 1, "value": 0.8, "delta": -0.2, "figures": {}}]},
               "generations": {"prompt": SCRIPT, "max_new_tokens": 4, "seed": 0, "baseline": IMG,
                               "rows": [{"layer": 0, "head": 1, "setting": 3.0, "text": f"{SCRIPT} then"}]}}
    path = tmp_path / "steer.html"
    path.write_text(steer_page(payload), encoding="utf-8")
    opened = open_page(path)
    curves = opened.page.evaluate("document.querySelector('.probe-steer-curves').data")
    assert [trace["name"] for trace in curves] == ["0.1", "1.2"] and curves[0]["y"] == [0.5, 1.0, 2.0]
    assert curves[0]["x"] == [0.0, 1.0, 3.0]
    bars = opened.page.evaluate("document.querySelector('.probe-steer-find').data")
    assert bars[0]["x"] == ["1.2", "0.1"] and bars[0]["y"] == [1.0, -0.2]
    cells = opened.page.locator(".probe-steer-generations td.probe-steer-text").all_text_contents()
    assert cells == [IMG, f"{SCRIPT} then"]  # shown as text, never run
    opened.check_clean()


@pytest.mark.slow
def test_name_mover_curve_on_smollm2_ioi_equals_the_hand_computation(smollm2: LoadedModel) -> None:
    """Done-when of issue 46: head 23.3 (the largest DLA on generated IOI pairs) scaled by 0..3, the logit difference
    equal to scaling its slice of layer 23's output projection's input by hand."""
    ioi = contrast_task(smollm2, "ioi", count=16, seed=0)
    clean = contrast_runs(smollm2, ioi)[0]
    result = steer_curves(smollm2, clean, [(23, 3)], [0.0, 1.0, 2.0, 3.0])
    margins = []
    for point in result.curves[0]["points"]:
        with scaled_projection(smollm2.model, 23, 3, point["setting"], 64):
            hand = float(logit_diffs(smollm2, ioi, ioi.clean).mean())
        assert point["figures"]["margin"] == pytest.approx(hand, abs=1e-3)
        assert point["value"] == pytest.approx(hand, abs=1e-3)  # read forwards: the logit difference itself
        margins.append(hand)
    assert margins == sorted(margins) and margins[-1] > margins[0] + 2.0  # turned up, the answer is pushed harder


@pytest.mark.parametrize("flag, word", [("--values", "value"), ("--alpha", "alpha")])
def test_the_table_names_the_values_by_the_flag_that_gave_them(flag: str, word: str, capsys, monkeypatch) -> None:
    planted = f"{Path(__file__).parent / 'planted.py'}:planted_textbook"
    code, stdout, stderr = run_cli(["steer", "--model", planted, "--heads", "1.1", flag, "0,2", "--data", "repeated",
                                    "--num-seqs", "2"], capsys, monkeypatch)
    assert code == 0, stderr
    lines = stdout.splitlines()
    assert lines[0].endswith(f": cross_entropy at each of {flag} (scale's alpha)"), lines[0]
    assert lines[1].split() == ["head", word, "0", word, "1", word, "2"]
    assert "Measured: cross_entropy, mean next-token cross-entropy over all predicted tokens (padding excluded)." \
        in lines and "Intervention: scale, its alpha set to each value." in lines
    assert not any(line.startswith("Values:") for line in lines)

"""QK attribution (probe.qk, probe qk): on tiny models of each family the pairs sum to the model's own score (and
their differences across keys to the eager attention's), a planted induction head's key side names the planted
previous-token head, half precision within its bound, the page in Chromium, the CSV, and the one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import run_cli, tiny_hf
from families import tiny_family
from planted import planted_gpt2
from test_browser import IMG, SCRIPT, browser, open_page  # noqa: F401
from probe.errors import ProbeError
from probe.models import LoadedModel
from probe.qk import qk_attribution

IDENTITY = 1e-5
PLANTED_GPT2 = f"{Path(__file__).parent / 'planted.py'}:planted_gpt2"


def _loaded(model: torch.nn.Module, name: str) -> LoadedModel:
    return LoadedModel(model=model, tokenizer=None, name=name, vocab_size=model.config.vocab_size)


def _sharpened(family: str) -> torch.nn.Module:
    """A tiny random model whose scores are far from 0 (weights scaled up), so that the identity is not vacuous."""
    model = tiny_hf("llama_mqa") if family == "llama_mqa" else tiny_family(family)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2 and ("q_proj" in name or "k_proj" in name or "c_attn" in name
                                         or "query_key_value" in name):
                parameter.mul_(6.0)
    return model


def _eager_log_weights(model: torch.nn.Module, ids: torch.Tensor, layer: int, head: int) -> torch.Tensor:
    """(positions, positions) log attention weights of the head, from transformers' own eager attention."""
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        weights = model(ids, output_attentions=True).attentions[layer][0, head]
    return weights.double().log()


@pytest.mark.parametrize("family", ["llama", "llama_mqa", "gpt2", "gpt_neox"])  # RoPE + GQA / MQA; LayerNorm +
# absolute positions; parallel attention and MLP (GPT-NeoX: partial rotary, fused query_key_value, biases)
def test_the_pairs_sum_to_the_models_own_score(family: str) -> None:
    model = _sharpened(family)
    loaded = _loaded(model, family)
    ids = torch.randint(3, 120, (2, 14), generator=torch.Generator().manual_seed(1))
    result = qk_attribution(loaded, ids, (1, 1), at="attended")
    for view in ("score", "contrast"):
        chosen = getattr(result, view)
        assert chosen.residual < IDENTITY and chosen.points > 0
        assert abs(float(result.pairs(view).sum()) - chosen.own / chosen.points) < IDENTITY
    assert abs(result.score.own / result.score.points) > 0.5  # not vacuous
    # one query against several keys: the pairs' differences are the eager attention's log-weight differences
    log_weights = _eager_log_weights(model, ids[:1], 1, 1)
    sums = [float(qk_attribution(loaded, ids[:1], (1, 1), query=9, key=key).pairs().sum()) for key in (0, 4, 9)]
    for key, value in zip((4, 9), sums[1:]):
        assert value - sums[0] == pytest.approx(float(log_weights[9, key] - log_weights[9, 0]), abs=IDENTITY)
    names = [component.name for component in result.components]
    assert names[0] == "embed" and names[-1] == "bias" and "L0H3" in names and "MLP0" in names
    assert ("pos" in names) == (family == "gpt2")  # absolute position embeddings are their own component
    assert result.kv_head == {"llama": 0, "llama_mqa": 0, "gpt2": 1, "gpt_neox": 1}[family]  # head 1's key side


def test_a_planted_induction_heads_key_side_names_the_previous_token_head() -> None:
    loaded = _loaded(planted_gpt2(), "planted")
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0)).repeat(1, 2)
    result = qk_attribution(loaded, ids, (1, 1), at="induction")
    assert result.top_key_components(1) == ["L0H0"]
    assert result.components[int(result.query_side().argmax())].name == "embed"  # the query's own token
    assert result.score.points == 2 * 12  # every query of the second copy (and repeats the first copy has by chance)
    assert result.top_key_components(1, view="contrast") == ["L0H0"]
    payload = result.to_dict()
    top = payload["views"]["score"]["top_pairs"][0]
    assert (payload["components"][top["query"]]["name"], payload["components"][top["key"]]["name"]) == ("embed",
                                                                                                         "L0H0")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_stays_within_its_rounding_bound(dtype: torch.dtype) -> None:
    """The check holds with the bound the dtype's rounding allows, and the half-precision pairs are those of float32
    within that bound."""
    ids = torch.randint(3, 120, (2, 14), generator=torch.Generator().manual_seed(1))
    exact = qk_attribution(_loaded(_sharpened("llama"), "llama"), ids, (1, 1), at="previous")
    half = qk_attribution(_loaded(_sharpened("llama").to(dtype), "llama"), ids, (1, 1), at="previous")
    assert half.dtype == str(dtype).removeprefix("torch.") and exact.dtype == "float32"
    bound = half.score.bound  # the stream's rounding measured + 4 eps |q| |k| scaling, largest over points
    assert 0 < half.score.residual <= bound  # the model rounds, within the bound
    assert abs(half.score.own - exact.score.own) / exact.score.points <= bound
    assert float((half.key_side() - exact.key_side()).abs().max()) <= bound


def test_the_qk_command_writes_json_csv_and_the_page(tmp_path: Path, capsys, monkeypatch) -> None:
    import pandas

    paths = {kind: tmp_path / f"qk.{kind}" for kind in ("json", "csv", "html")}
    code, out, err = run_cli(["qk", "--model", PLANTED_GPT2, "--head", "1.1", "--at", "induction", "--num-seqs", "2",
                              "--repeat-len", "8", *[arg for kind, path in paths.items()
                                                     for arg in (f"--{kind}", str(path))]], capsys, monkeypatch)
    assert code == 0, err
    assert "L0H0" in out and "largest |pairs - model's own|" in out and "Computed in float32" in out
    payload = json.loads(paths["json"].read_text(encoding="utf-8"))
    assert payload["schema"] == "probe/qk" and payload["dtype"] == "float32" and payload["rule"] == "induction"
    rows = pandas.read_csv(paths["csv"])
    assert list(rows.columns[:4]) == ["rank", "query", "query_layer", "query_head"]
    assert all(rows[column].dtype.kind == "i" for column in ("query_layer", "query_head", "key_layer", "key_head"))
    assert (rows.iloc[0]["query"], rows.iloc[0]["key"], rows.iloc[0]["key_layer"]) == ("embed", "L0H0", 0)
    assert len(rows) == len(payload["components"]) ** 2


@pytest.mark.slow
def test_the_page_draws_the_pair_matrix_with_its_marginals(tmp_path: Path, open_page) -> None:  # noqa: F811
    from probe.reports.qk import qk_page

    ids = torch.randint(0, 200, (2, 10), generator=torch.Generator().manual_seed(0)).repeat(1, 2)
    payload = qk_attribution(_loaded(planted_gpt2(), "planted"), ids, (1, 1), at="induction").to_dict()
    payload["model"] = SCRIPT
    payload["source"] = f"text {IMG}"
    path = tmp_path / "qk.html"
    path.write_text(qk_page(payload), encoding="utf-8")
    opened = open_page(path)
    assert opened.page.text_content("h1") == f"QK attribution of head 1.1 of {SCRIPT}"
    drawn = opened.page.evaluate("document.querySelector('.probe-qk-matrix').data")
    heatmap, query_side, key_side = drawn
    assert heatmap["x"][0] == "L0H0" and heatmap["y"][0] == "embed"
    assert heatmap["z"][0][0] == pytest.approx(payload["views"]["score"]["matrix"][0][2], abs=1e-6)
    assert query_side["x"][0] == pytest.approx(payload["views"]["score"]["query"][0], abs=1e-6)
    assert key_side["y"][0] == pytest.approx(payload["views"]["score"]["key"][2], abs=1e-6)
    assert opened.page.locator(".probe-qk-matrix .heatmaplayer image").count() == 2  # score and contrast
    opened.check_clean()


def _config_folder(tmp_path: Path, config: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return str(tmp_path)


@pytest.mark.parametrize("config, message", [
    ({"model_type": "gemma2", "attn_logit_softcapping": 50.0, "num_hidden_layers": 2}, "soft-capping"),
    ({"model_type": "deepseek_v3", "kv_lora_rank": 16, "num_hidden_layers": 2}, "latent attention"),
    ({"model_type": "t5", "is_encoder_decoder": True, "num_layers": 2}, "cross-attention"),
])
def test_what_cannot_be_exact_is_refused_before_the_model_loads(config, message, tmp_path, capsys,
                                                                  monkeypatch) -> None:
    code, out, err = run_cli(["qk", "--model", _config_folder(tmp_path, config), "--head", "1.0"], capsys,
                             monkeypatch)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and message in err


@pytest.mark.parametrize("args, message", [
    (["--head", "17"], "LAYER.HEAD"), (["--head", "1.1", "--at", "nowhere"], "--at 'nowhere'"),
    (["--head", "1.1", "--query", "3"], "--query and --key together"), (["--head", "5.0"], "layer 5"),
    (["--head", "1.9"], "head 9"),
])
def test_the_qk_command_refuses_bad_input_in_one_line(args, message, capsys, monkeypatch) -> None:
    code, out, err = run_cli(["qk", "-q", "--model", PLANTED_GPT2, "--num-seqs", "1", "--repeat-len", "4", *args],
                             capsys, monkeypatch)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


@pytest.mark.parametrize("build, message", [
    (lambda: tiny_family("gptj"), "attention interface"),  # read through a family adapter: no queries and keys handed
    (lambda: tiny_hf("bert"), "LM head"),
    (lambda: tiny_hf("gemma2"), "soft-capping"),  # a model in memory: its config is read once it is loaded
])
def test_a_loaded_model_it_cannot_decompose_is_refused_in_one_line(build, message) -> None:
    model = build()
    with pytest.raises(ProbeError, match=message) as refused:
        qk_attribution(_loaded(model, "tiny"), torch.randint(3, 100, (1, 8)), (1, 0))
    assert "\n" not in str(refused.value)


def test_smollm2_induction_head_reads_the_previous_token_head(smollm2) -> None:
    """17.3, SmolLM2's induction head, on repeated random tokens: its keys are read through 16.0, the head
    `probe circuits` finds K-composing into it by the weights alone."""
    from probe.inputs import ProbeOptions, build_probe_set

    probe_set = build_probe_set("repeated", smollm2, ProbeOptions(num_seqs=2))
    result = qk_attribution(smollm2, probe_set.input_ids, (17, 3), at="induction")
    assert result.top_key_components(1) == ["L16H0"]
    assert result.score.residual < 1e-3 and result.score.own / result.score.points > 3

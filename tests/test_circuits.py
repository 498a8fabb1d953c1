"""Weight-based scores: composition and copying against direct computation, and on a planted circuit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import tiny_hf
from planted import planted_textbook
from probe.circuits import composition_scores, copying_scores, layer_weights
from probe.hooks.layers import attention_layers


def _direct_llama(model, layer: int, head: int) -> dict[str, torch.Tensor]:
    """W_OV, W_QK of one head of a llama model, built straight from the projections (d_model x d_model)."""
    attn = model.model.layers[layer].self_attn
    gain = model.model.layers[layer].input_layernorm.weight.double()
    dh = attn.head_dim
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    kv = head // group
    q = attn.q_proj.weight.double()[head * dh:(head + 1) * dh] * gain  # (d_head, d_model)
    k = attn.k_proj.weight.double()[kv * dh:(kv + 1) * dh] * gain
    v = attn.v_proj.weight.double()[kv * dh:(kv + 1) * dh] * gain
    o = attn.o_proj.weight.double()[:, head * dh:(head + 1) * dh]  # (d_model, d_head)
    return {"ov": v.T @ o.T, "qk": q.T @ k}


def _score(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.norm(a @ b) / (torch.linalg.norm(a) * torch.linalg.norm(b)))


def test_composition_equals_direct_computation_on_a_tiny_grouped_query_model():
    model = tiny_hf("llama_gqa").requires_grad_(False)
    with torch.no_grad():  # gains other than 1, so that folding them matters
        for block in model.model.layers:
            block.input_layernorm.weight.uniform_(0.5, 1.5)
    composition = composition_scores(model)
    for a_head in range(4):
        for b_head in range(4):
            a, b = _direct_llama(model, 0, a_head), _direct_llama(model, 1, b_head)
            assert composition.score("k", (0, a_head), (1, b_head)) == pytest.approx(_score(a["ov"], b["qk"].T),
                                                                                     rel=1e-9)
            assert composition.score("q", (0, a_head), (1, b_head)) == pytest.approx(_score(a["ov"], b["qk"]), rel=1e-9)
            assert composition.score("v", (0, a_head), (1, b_head)) == pytest.approx(_score(a["ov"], b["ov"]), rel=1e-9)
    assert torch.isnan(composition.scores["k"][1, :, 0, :]).all()  # a later head does not compose into an earlier one
    assert 0 < composition.baseline < 1


def test_grouped_query_heads_share_their_group_key_and_value_weights():
    model = tiny_hf("llama_gqa")  # 4 query heads, 2 key/value heads
    weights = layer_weights(model, attention_layers(model)[0])
    assert torch.equal(weights.W_K[0], weights.W_K[1]) and torch.equal(weights.W_V[2], weights.W_V[3])
    assert not torch.equal(weights.W_K[1], weights.W_K[2])


def test_gpt2_weights_reproduce_the_attention_output():
    model = tiny_hf("gpt2")
    attn = model.transformer.h[0].attn
    weights = layer_weights(model, attention_layers(model)[0])
    x = torch.randn(3, 64, dtype=torch.float64)
    gain = model.transformer.h[0].ln_1.weight.double()
    q = (x * gain) @ attn.c_attn.weight.double()[:, :64]  # Conv1D: x @ weight
    assert torch.allclose(x @ weights.W_Q[2], q[:, 32:48])
    assert weights.W_O.shape == (4, 16, 64)


def test_copying_score_equals_the_eigenvalues_of_the_full_vocabulary_matrix():
    model = tiny_hf("llama_gqa").requires_grad_(False)
    scores = copying_scores(model)
    W_E = model.model.embed_tokens.weight.double()
    W_U = (model.model.norm.weight.double()[:, None] * model.lm_head.weight.double().T)
    direct = _direct_llama(model, 1, 3)["ov"]
    eigenvalues = torch.linalg.eigvals(W_E @ direct @ W_U)  # (vocab,) of which d_head are non-zero
    expected = float(eigenvalues.sum().real / eigenvalues.abs().sum())
    assert float(scores[1, 3]) == pytest.approx(expected, abs=1e-6)


def test_planted_previous_token_head_composes_into_the_induction_head_above_the_baseline():
    composition = composition_scores(planted_textbook(), kinds=("k",))
    into_induction = composition.scores["k"][0, :, 1, 1]  # every layer-0 head into 1.1
    assert composition.score("k", (0, 0), (1, 1)) > 2 * composition.baseline  # 1/sqrt(200) against ~1/sqrt(1024)
    assert int(into_induction.argmax()) == 0  # the previous-token head ranks first in its layer
    assert composition.rank_in_layer("k", (0, 0), (1, 1)) == 1
    assert composition.score("k", (0, 1), (1, 1)) < composition.baseline  # the sink head writes nowhere 1.1 reads


def _planted_loaded():
    from probe.models import LoadedModel

    return LoadedModel(model=planted_textbook(), tokenizer=None, name="planted", vocab_size=200)


def test_circuits_finds_the_planted_pair_and_confirms_it_causally():
    from probe.circuits.pairs import circuits

    result = circuits(_planted_loaded(), seq_len=64, num_seqs=4, repeat_len=20, batch_size=4)
    (pair,) = result.pairs
    assert pair.induction == (1, 1) and pair.feeders[0].head == (0, 0) and pair.feeders[0].previous_token
    assert pair.checked == (0, 0)
    # the previous-token head alone breaks induction (its only consumer), and together costs no more than 1.1 alone
    assert pair.deltas["feeder"] > 1.0 and pair.deltas["induction"] > 1.0
    assert pair.interaction < 0
    payload = result.to_dict()
    assert payload["previous_token_pairs"]["ranked_first_in_layer"] == payload["previous_token_pairs"]["pairs"] == 1


def test_circuits_reports_its_check_after_the_classification_to_its_total():
    from probe.circuits.pairs import circuits

    loaded = _planted_loaded()
    events: list[tuple[str, int, int]] = []
    circuits(loaded, seq_len=64, num_seqs=4, repeat_len=20, batch_size=4,
             progress=lambda stage, done, total: events.append((stage, done, total)))
    stages = list(dict.fromkeys(stage for stage, _, _ in events))
    assert stages == ["K-composition", "classifying heads", "ablation check"]
    stage, done, total = events[-1]
    assert stage == "ablation check" and done == total > 0


def test_circuits_command_writes_json_and_csv(tmp_path, capsys, monkeypatch):
    from conftest import run_cli

    spec = f"{Path(__file__).parent / 'planted.py'}:planted_textbook"
    code, out, err = run_cli(["circuits", "--model", spec, "--seq-len", "64", "--num-seqs", "4", "--repeat-len", "20",
                              "--json", str(tmp_path / "c.json"), "--csv", str(tmp_path / "c.csv")], capsys,
                             monkeypatch)
    assert code == 0, err
    assert "1.1" in out and "0.0 P" in out
    payload = json.loads((tmp_path / "c.json").read_text())
    assert payload["induction_heads"][0]["checked"] == {"layer": 0, "head": 0}
    lines = (tmp_path / "c.csv").read_text().splitlines()
    assert lines[0].startswith("name,layer,head,induction_score,")  # a plain table: provenance beside it
    assert (tmp_path / "c.provenance.json").is_file()
    code, _, err = run_cli(["circuits", "--model", spec, "--top", "0"], capsys, monkeypatch)
    assert code == 2 and "--top" in err

"""KV-cache head maps: retrieval and streaming scores on a planted model, window ablation against hand-written masked
attention, GQA aggregation, the needle set, the exports read back as their consumers read them, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_cli, tiny_loaded
from test_browser import browser  # noqa: F401  (the fixture)

from probe.ablation.methods import ablate
from probe.ablation.window import PatternAblation, WindowAblation
from probe.inputs import natural_set
from probe.kv import (CURVE_SEED_OFFSET, aggregate, kv_groups, kv_heads, loss_order, needle_accuracy, stream_curve,
                     text_loss)
from probe.kv.pipeline import _held_out
from probe.models import load_model
from probe.reports.kv_heads import kv_heads_report
from rich.console import Console
from probe.inputs import NeedleOptions, needle_set

TESTS = Path(__file__).parent
PLANTED = f"{TESTS / 'planted.py'}:planted_textbook"
PLANTED_HF = f"{TESTS / 'planted.py'}:planted_gpt2"


def test_the_kernels_top_keys_and_the_weights_score_retrieval_as_wu_et_al_by_hand() -> None:
    """probe.kv's score from each answer row's top key and SCORES["retrieval"]'s from the weights are one definition:
    both equal the fraction, counted by hand, of copied and correctly predicted rows whose top key is the needle."""
    from probe.heads.scores import NeedleBatch, retrieval_score
    from probe.kv.scoring import _retrieval_of_prompt

    generator = torch.Generator().manual_seed(0)
    b, h, n = 2, 3, 12
    sources = torch.randint(-1, n, (b, n), generator=generator)
    sources[sources % 3 == 0] = -1  # rows whose target the needle does not give
    correct = torch.rand(b, n, generator=generator) > 0.3
    weights = torch.rand(b, h, n, n, generator=generator).softmax(dim=-1)
    for bi, head, row in [(0, 0, i) for i in range(n)] + [(1, 2, i) for i in range(0, n, 2)]:
        if sources[bi, row] >= 0:  # head 0 copies on prompt 0, head 2 on half of prompt 1's rows
            weights[bi, head, row, sources[bi, row]] = 2.0
    scored = [(bi, row) for bi in range(b) for row in range(n) if sources[bi, row] >= 0 and correct[bi, row]]
    by_hand = torch.tensor([sum(int(weights[bi, head, row].argmax()) == int(sources[bi, row]) for bi, row in scored)
                            / len(scored) for head in range(h)], dtype=torch.float64)
    assert by_hand[0] > 0 and by_hand[2] > 0
    hits, counts = retrieval_score(weights, 0, NeedleBatch(valid=torch.ones(b, n, dtype=torch.bool), offset=0,
                                                           repeat_len=None, sources=sources, correct=correct))
    assert torch.equal(hits / counts, by_hand)
    from_tops = _retrieval_of_prompt({0: weights.argmax(dim=-1)}, sources, correct, 1, h)
    assert from_tops is not None and torch.equal(from_tops[0], by_hand)


def test_planted_retrieval_and_streaming_heads_score_one_and_the_others_near_zero() -> None:
    """1.1 copies the token after the earlier copy (the needle's key); 0.0 (previous token) and 0.1 (sink) look only
    at sink + recent keys; the random heads spread their attention."""
    loaded = load_model(PLANTED)
    result = kv_heads(loaded, lengths=(250,), depths=(0.2, 0.5, 0.8), prompts=2, sink=1, recent=4, curve=False)
    retrieval, streaming = result.retrieval, result.streaming
    assert retrieval[1, 1] > 0.99
    others = [(layer, head) for layer in range(2) for head in range(4) if (layer, head) != (1, 1)]
    assert all(retrieval[h] < 0.01 for h in others)
    assert streaming[0, 0] > 0.99 and streaming[0, 1] > 0.99
    assert all(streaming[h] < 0.15 for h in others if h not in ((0, 0), (0, 1)))
    assert all(row["accuracy"] == 1.0 for row in result.accuracy)  # the planted model retrieves every key
    assert result.order[-1] == (1, 1)  # the retrieval head streams last


@pytest.mark.parametrize("bound", [-1e9, 0.0, 1e9])
def test_the_calibrated_budget_is_the_largest_accepted_k_of_the_points_it_measured(bound: float) -> None:
    """A grouped-query Llama (4 KV heads): the budget streams the most heads whose measured point is accepted, the
    next k is measured and refused, the points are a bisection's (not a grid), and each reported point is measured
    again here, by hand, with a fresh window ablation on the held-out texts and needle prompts."""
    loaded = tiny_loaded("llama_gqa")
    result = kv_heads(loaded, lengths=(100,), depths=(0.5,), sink=2, recent=8, curve=False, max_loss_increase=bound,
                      curve_texts=1)
    budget, total = result.budget, 4
    points = {point["k"]: point for point in budget.points}
    assert budget.rule.startswith("calibrated") and budget.total == total and len(points) <= 3
    assert budget.streamed == max([k for k, point in points.items() if point["accepted"]], default=0)
    assert budget.streamed == total or not points[budget.streamed + 1]["accepted"]
    assert budget.streamed == {-1e9: 0, 1e9: total}.get(bound, budget.streamed)
    assert result.full == set(result.order[budget.streamed:])
    held_out = needle_set(loaded, NeedleOptions(seed=2000, lengths=(100,), depths=(0.5,)))
    texts = natural_set(loaded, seq_len=99, num_seqs=2).input_ids[1:]
    baseline = text_loss(loaded, texts)
    for k, point in points.items():
        heads = [(layer, kv * 2 + offset) for layer, kv in result.order[:k] for offset in range(2)]
        with ablate(loaded.model, heads, method=WindowAblation(sink=2, recent=8)):
            run = needle_accuracy(loaded, held_out)
            loss = text_loss(loaded, texts)
        assert point["needle_accuracy"] == pytest.approx(sum(run.exact) / len(run.exact))
        assert point["loss_change"] == pytest.approx(loss - baseline, abs=1e-5)
        assert point["accepted"] == (point["loss_change"] <= bound and point["needle_accuracy"] >=
                                     budget.measured_on["baseline_needle_accuracy"])
    assert result.to_dict()["budget"]["points"] == budget.points


def test_the_loss_order_streams_the_cheapest_kv_heads_first_and_retrieving_ones_last() -> None:
    """Each KV head's loss change when it alone streams, from the exact sweep, equals a window ablation of its group
    by hand (mean next-token loss on the same text); heads whose retrieval score passes the floor go last."""
    loaded = tiny_loaded("llama_gqa")  # 2 layers x 2 KV heads, 2 query heads each
    texts = natural_set(loaded, seq_len=99, num_seqs=1)
    retrieval = torch.tensor([[0.0, 0.5], [0.05, 0.0]])  # KV head 0.1 retrieves
    window = WindowAblation(sink=2, recent=8)
    order, changes = loss_order(loaded, retrieval, texts, window)
    assert order[-1] == (0, 1) and sorted(order) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert changes[:3] == sorted(changes[:3])
    baseline = text_loss(loaded, texts.input_ids)
    for (layer, kv), change in zip(order, changes):
        with ablate(loaded.model, [(layer, 2 * kv), (layer, 2 * kv + 1)], method=window):
            assert change == pytest.approx(text_loss(loaded, texts.input_ids) - baseline, abs=1e-5)


def test_kv_heads_ordered_by_loss_uses_loss_order_on_texts_no_other_stage_reads() -> None:
    loaded = tiny_loaded("llama_gqa")
    result = kv_heads(loaded, lengths=(100,), depths=(0.5,), sink=2, recent=8, curve=False, full_fraction=0.5,
                      curve_texts=1, order_by="loss")
    texts = natural_set(loaded, seq_len=99, num_seqs=3)
    alone = natural_set(loaded, seq_len=99, num_seqs=1)
    alone.input_ids = texts.input_ids[2:]  # the third sequence: the curve reads the first, the budget the second
    order, _ = loss_order(loaded, result.kv_retrieval, alone, WindowAblation(sink=2, recent=8))
    assert result.order == order and result.options["order_by"] == "loss"


@pytest.fixture(scope="module")
def planted_hf():
    """The planted heads in a transformers GPT-2 (one retrieval head, 1.1), mapped with every default but the small
    cache: a calibrated budget and a curve against three random orders that stop once clearly below."""
    loaded = load_model(PLANTED_HF)
    return loaded, kv_heads(loaded, lengths=(250,), depths=(0.2, 0.5, 0.8), prompts=2, sink=1, recent=4, steps=4,
                            random_seeds=(0, 1, 2), curve_texts=1)


@pytest.mark.slow  # over 10 s on 2 cores
def test_the_calibrated_map_keeps_the_planted_retrieval_head_full_and_streams_the_others(planted_hf) -> None:
    _, result = planted_hf
    assert result.budget.rule.startswith("calibrated")
    assert result.full == {(1, 1)} and result.budget.streamed == 7 and result.order[-1] == (1, 1)
    assert float(result.kv_retrieval[1, 1]) == pytest.approx(1.0)
    refused = [point for point in result.budget.points if not point["accepted"]]
    assert [point["k"] for point in refused] == [8] and refused[0]["needle_accuracy"] < 1.0


@pytest.mark.slow  # over 10 s on 2 cores
def test_a_random_order_stops_once_refused_where_probes_order_is_kept(planted_hf) -> None:
    """Each stopped order's stopping point is refused by the budget's rule while probe's is kept there; it measured
    nothing after it but the points probe's order measured (k = all); every value it has equals the value a curve
    that measures every point gets."""
    loaded, result = planted_hf
    curve, bound = result.curve, result.options["max_loss_increase"]
    probe = curve["orders"]["probe"]
    assert curve["stopped"] and all(value is not None for value in probe["loss_change"] + probe["needle_accuracy"])
    inputs = _held_out(loaded, NeedleOptions(seed=0, lengths=(250,), depths=(0.2, 0.5, 0.8), prompts=2), None, 1, 0,
                       CURVE_SEED_OFFSET, WindowAblation(sink=1, recent=4))
    every = stream_curve(loaded, result.order, inputs, curve["k"], [0, 1, 2], stop_below=None)
    assert every["stopped"] == {} and every["orders"]["probe"] == probe
    for name, k in curve["stopped"].items():
        at = curve["k"].index(k)
        ours, theirs = curve["orders"][name], every["orders"][name]
        refused = ours["needle_accuracy"][at] < curve["baseline_needle_accuracy"] or ours["loss_change"][at] > bound
        kept = probe["needle_accuracy"][at] >= curve["baseline_needle_accuracy"] and probe["loss_change"][at] <= bound
        assert refused and kept
        assert all(value is None for value in ours["loss_change"][at + 1:-1]) and ours["loss_change"][-1] is not None
        for key in ("loss_change", "needle_accuracy"):
            measured = [v for v, o in zip(theirs[key], ours[key]) if o is not None]
            assert [v for v in ours[key] if v is not None] == measured
    console = Console(width=200, record=True)
    kv_heads_report(result.to_dict(), console)
    text = console.export_text()
    assert all(f"{name.replace('_', ' seed ')} stopped at k = {k}" in text for name, k in curve["stopped"].items())


def test_a_model_that_cannot_be_windowed_gets_the_fixed_budget_and_says_why() -> None:
    result = kv_heads(load_model(PLANTED), lengths=(120,), depths=(0.5,), sink=1, recent=4, curve=False)
    assert result.budget.rule.startswith("fixed: the last 0.25 of the order full (a calibrated budget measures")
    assert len(result.full) == 2 and result.budget.points == []


def _by_hand(attn: torch.nn.Module, hidden: torch.Tensor, position: tuple[torch.Tensor, torch.Tensor],
             windowed: set[int], sink: int, recent: int, keys: torch.Tensor | None = None) -> torch.Tensor:
    """Llama attention written out: RoPE, GQA by repeating KV heads, a per-head mask, softmax, output projection."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    b, n, _ = hidden.shape
    d = attn.head_dim
    q = attn.q_proj(hidden).view(b, n, -1, d).transpose(1, 2)
    k = attn.k_proj(hidden).view(b, n, -1, d).transpose(1, 2)
    v = attn.v_proj(hidden).view(b, n, -1, d).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, *position)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    causal = j <= i
    window = causal & (((j < sink) | (j > i - recent)) if keys is None else keys)
    allowed = torch.stack([window if head in windowed else causal for head in range(q.shape[1])])  # (hq, n, n)
    scores = (q @ k.transpose(-1, -2)) * d**-0.5
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    return attn.o_proj((weights @ v).transpose(1, 2).reshape(b, n, -1))


@pytest.mark.parametrize("implementation,length,recent,windowed", [
    ("sdpa", 40, 5, {1, 2}), ("eager", 40, 5, {1, 2}), ("sdpa", 300, 50, {1, 2}), ("sdpa", 300, 50, {0, 1, 2, 3})])
def test_window_ablation_equals_hand_written_masked_attention(implementation: str, length: int, recent: int,
                                                              windowed: set[int]) -> None:
    """300 tokens: several query blocks, each gathering its sink and its own recent keys; every head of the layer
    windowed: the layer's own attention is skipped."""
    loaded = tiny_loaded("llama_gqa")
    loaded.model.config._attn_implementation = implementation
    attn = loaded.model.model.layers[0].self_attn
    seen: dict[str, object] = {}

    def before(module, args, kwargs):
        seen["hidden"] = kwargs.get("hidden_states", args[0] if args else None)
        seen["position"] = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)

    def after(module, args, kwargs, output):
        seen["output"] = output[0]

    ids = torch.randint(0, 120, (2, length), generator=torch.Generator().manual_seed(1))
    handles = [attn.register_forward_pre_hook(before, with_kwargs=True),
               attn.register_forward_hook(after, with_kwargs=True)]
    try:
        with torch.no_grad(), ablate(loaded.model, [(0, head) for head in sorted(windowed)],
                                     method=WindowAblation(sink=2, recent=recent)):
            loaded.model(ids)
        with torch.no_grad():
            expected = _by_hand(attn, seen["hidden"], seen["position"], windowed, 2, recent)
    finally:
        for handle in handles:
            handle.remove()
    assert torch.allclose(seen["output"], expected, atol=1e-5)
    with torch.no_grad():  # restored on exit: the plain model again
        loaded.model(ids)
        plain = _by_hand(attn, seen["hidden"], seen["position"], set(), 2, recent)
    assert not torch.allclose(plain, expected, atol=1e-3)


class EvenKeys(PatternAblation):
    """A pattern ablation of one's own: the head sees the even positions and itself (every earlier key may be
    needed, so it keeps the default key_spans)."""

    name = "even_keys"

    def allowed_keys(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        return (keys[None, :] % 2 == 0) | (keys[None, :] == queries[:, None])


def test_a_pattern_ablation_of_ones_own_is_one_class() -> None:
    loaded = tiny_loaded("llama_gqa")
    attn = loaded.model.model.layers[1].self_attn
    seen: dict[str, object] = {}

    def before(module, args, kwargs):
        seen["hidden"], seen["position"] = kwargs["hidden_states"], kwargs["position_embeddings"]

    def after(module, args, kwargs, output):
        seen["output"] = output[0]

    ids = torch.randint(0, 120, (1, 150), generator=torch.Generator().manual_seed(3))
    handles = [attn.register_forward_pre_hook(before, with_kwargs=True),
               attn.register_forward_hook(after, with_kwargs=True)]
    try:
        with torch.no_grad(), ablate(loaded.model, [(1, 3)], method=EvenKeys()):
            loaded.model(ids)
        i, j = torch.arange(150)[:, None], torch.arange(150)[None, :]
        with torch.no_grad():
            expected = _by_hand(attn, seen["hidden"], seen["position"], {3}, 0, 1, keys=(j % 2 == 0) | (j == i))
    finally:
        for handle in handles:
            handle.remove()
    assert torch.allclose(seen["output"], expected, atol=1e-5)


@pytest.mark.parametrize("name", ["llama_gqa", "gemma2", "gpt2"])
def test_a_window_wider_than_the_input_changes_nothing_and_a_narrow_one_does(name: str) -> None:
    """Soft-capped logits and sliding-window layers (gemma2), a padded batch, several query blocks: the restricted
    computation equals the model's own where the window keeps every key."""
    loaded = tiny_loaded(name)
    ids = torch.randint(1, 120, (2, 200), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 150:] = 0  # the second row is right-padded
    heads = [(0, 0), (1, 2), (1, 3)]
    with torch.no_grad():
        plain = loaded.model(ids, attention_mask=mask).logits
        with ablate(loaded.model, heads, method=WindowAblation(sink=0, recent=200)):
            wide = loaded.model(ids, attention_mask=mask).logits
        with ablate(loaded.model, heads, method=WindowAblation(sink=1, recent=3)):
            narrow = loaded.model(ids, attention_mask=mask).logits
            alone = loaded.model(ids[1:, :150]).logits  # the padded row's text, unpadded
    assert torch.allclose(wide[0], plain[0], atol=1e-5) and torch.allclose(wide[1, :150], plain[1, :150], atol=1e-5)
    assert not torch.allclose(narrow[0], plain[0], atol=1e-3)
    assert torch.allclose(narrow[1, :150], alone[0], atol=1e-5)  # padding changes nothing of the real tokens


def test_window_ablation_in_a_sweep_matches_the_naive_path() -> None:
    from probe.ablation import sweep

    loaded = tiny_loaded("llama_gqa")
    probe_set = natural_set(loaded, seq_len=60, num_seqs=2)
    method = WindowAblation(sink=1, recent=4)
    groups = [[(0, 0), (0, 1)], [(0, 0), (0, 1), (0, 2), (0, 3)]]  # the second: every head of layer 0
    exact = sweep(loaded, probe_set, [(1, 0), (1, 3)], groups=groups, method=method)
    naive = sweep(loaded, probe_set, [(1, 0), (1, 3)], groups=groups, method=method, mode="naive")
    assert exact.path.startswith("exact")
    for a, b in zip(exact.results, naive.results):
        assert a.loss == pytest.approx(b.loss, abs=1e-5)
        assert a.loss != pytest.approx(exact.baseline_loss, abs=1e-7)


@pytest.fixture(scope="module")
def tiny_result():
    """kv_heads with its curve on a tiny Llama with grouped KV heads (4 query heads, 2 KV heads)."""
    return kv_heads(tiny_loaded("llama_gqa"), lengths=(100,), depths=(0.5,), sink=2, recent=8, steps=2,
                    random_seeds=(0,), curve_texts=1, full_fraction=0.5)


def test_gqa_aggregation_streams_a_kv_head_only_if_every_query_head_can(tiny_result) -> None:
    loaded = tiny_loaded("llama_gqa")  # 4 query heads, 2 KV heads
    assert kv_groups(loaded) == (4, 2)
    scores = torch.tensor([[0.1, 0.9, 0.3, 0.2], [0.5, 0.4, 0.0, 0.8]])
    assert torch.equal(aggregate(scores, 2, "max"), torch.tensor([[0.9, 0.3], [0.5, 0.8]]))
    assert torch.equal(aggregate(scores, 2, "min"), torch.tensor([[0.1, 0.2], [0.4, 0.0]]))
    payload = tiny_result.to_dict()
    assert len(payload["kv_heads"]) == 4 and len(payload["heads"]) == 8
    for row in payload["kv_heads"]:
        group = [h for h in payload["heads"] if h["layer"] == row["layer"] and h["kv_head"] == row["kv_head"]]
        assert row["retrieval"] == max(h["retrieval"] for h in group)
        assert row["streaming"] == min(h["streaming"] for h in group)
    assert payload["n_streaming"] == 2
    curve = payload["curve"]
    assert curve["k"] == [0, 2, 4]
    ends = {name: (order["loss_change"][0], order["loss_change"][-1]) for name, order in curve["orders"].items()}
    assert all(first == 0.0 for first, _ in ends.values())
    assert len({last for _, last in ends.values()}) == 1  # every head streamed: the same model whatever the order


def test_needle_set_places_the_key_and_its_sources(smollm2) -> None:
    needles = needle_set(smollm2, NeedleOptions(lengths=(200, 260), depths=(0.0, 1.0), seed=3))
    assert needles.input_ids.shape == (4, 260)
    for row in range(4):
        length = needles.cells[row][0]
        ids, sources = needles.input_ids[row], needles.sources[row]
        queries = (sources >= 0).nonzero().squeeze(1)
        assert len(queries) == 6  # six digits; the space token carries nothing of the key
        assert int(queries[-1]) == length - 2  # the last query predicts the last token
        for query in queries.tolist():  # each answer token is the needle token it names
            assert ids[query + 1] == ids[sources[query]]
        assert needles.keys[row] in smollm2.tokenizer.decode(ids[:length])


def test_exports_read_back_as_their_consumers_read_them(tmp_path: Path, capsys, monkeypatch) -> None:
    out = tmp_path / "duo"
    code, _, err = run_cli(["kv-heads", "--model", PLANTED, "--lengths", "120", "--depths", "0.5", "--sink", "1",
                            "--recent", "4", "--no-curve", "--full-fraction", "0.25",
                            "--export", f"duo:{out}", "--export", f"razor:{tmp_path / 'razor.json'}",
                            "--export", f"headkv:{tmp_path / 'headkv.json'}", "--json", str(tmp_path / "kv.json")],
                           capsys, monkeypatch)
    assert code == 0, err
    table = np.loadtxt(out / "full_attention_heads.tsv", dtype=float, delimiter="\t")  # DuoAttention's reader
    assert table.shape == (2, 4) and ((table >= 0) & (table <= 1)).all()
    config = json.loads((out / "config.json").read_text())
    assert config["sink_size"] == 1 and config["recent_size"] == 4
    payload = json.loads((tmp_path / "kv.json").read_text())
    full = {(row["layer"], row["kv_head"]) for row in payload["kv_heads"] if row["label"] == "full"}
    assert full == {(layer, kv) for layer in range(2) for kv in range(4) if table[layer, kv] > 0.5}
    assert len(full) == 2 and (1, 1) in full
    razor = json.loads((tmp_path / "razor.json").read_text())
    assert {(int(layer), kv) for layer, heads in razor.items() for kv in heads} == full
    with open(tmp_path / "headkv.json") as file:  # as HeadKV reads it: the first line, values in file order
        headkv = json.loads(file.readline())
    scores = np.array([np.mean(value) for value in headkv.values()]).reshape(2, 4)
    assert list(headkv) == [f"{layer}-{head}" for layer in range(2) for head in range(4)]
    assert scores[1, 1] > 0.99 and scores.sum() == pytest.approx(scores[1, 1])
    for sidecar in (out / "probe_budget.json", tmp_path / "razor.budget.json", tmp_path / "headkv.budget.json"):
        record = json.loads(sidecar.read_text())
        assert record["budget"]["rule"] == "fixed: the last 0.25 of the order full" and record["n_streaming"] == 6
        assert {tuple(h) for h in record["streaming"]} == {(layer, kv) for layer in range(2) for kv in range(4)} - full


@pytest.mark.parametrize("args, expected", [
    (["--lengths", "400"], "longer than the model's context of 256"),
    (["--export", "vllm:x.json"], "unknown export format 'vllm'"),
    (["--export", "duo"], "FORMAT:PATH"),
    (["--order", "random"], "--order 'random': use one of retrieval, loss"),
])
def test_bad_input_is_one_line(args: list[str], expected: str, capsys, monkeypatch) -> None:
    code, _, err = run_cli(["kv-heads", "--model", PLANTED, "--no-curve", *args], capsys, monkeypatch)
    assert code == 2
    assert expected in err and len(err.strip().splitlines()) == 1


def test_a_needle_whose_key_tokenizes_differently_is_one_line(smollm2, capsys, monkeypatch) -> None:
    """SmolLM2's tokenizer reads the key after `Code:` as other tokens than the key alone: refused in one line."""
    monkeypatch.setattr("probe.cli.kv_heads.load", lambda *args, **kwargs: smollm2)  # the session's model
    code, _, err = run_cli(["kv-heads", "--model", "smollm2", "--no-curve", "--needle", "Code:{key}"], capsys,
                           monkeypatch)
    assert code == 2
    assert "tokenizes its key differently" in err and len(err.strip().splitlines()) == 1


def test_existing_output_needs_force(tmp_path: Path, capsys, monkeypatch) -> None:
    target = tmp_path / "razor.json"
    target.write_text("{}")
    code, _, err = run_cli(["kv-heads", "--model", PLANTED, "--lengths", "120", "--no-curve",
                            "--export", f"razor:{target}"], capsys, monkeypatch)
    assert code == 2 and "--force" in err and len(err.strip().splitlines()) == 1
    assert target.read_text() == "{}"


@pytest.mark.slow
@pytest.mark.browser
def test_kv_heads_page_draws_the_map_and_the_curve(tiny_result, tmp_path: Path, browser) -> None:  # noqa: F811
    from test_browser import Opened, screenshot
    from test_html import SCRIPT

    from probe.reports.kv_heads import kv_heads_page

    payload = tiny_result.to_dict() | {"model": SCRIPT}
    path = tmp_path / "kv.html"
    path.write_text(kv_heads_page(payload), encoding="utf-8")
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    try:
        page = context.new_page()
        opened = Opened(page, path.resolve().as_uri())
        page.on("console", lambda message: opened.console.append((message.type, message.text)))
        page.on("pageerror", lambda error: opened.errors.append(str(error)))
        page.on("request", lambda request: opened.requests.append(request.url))
        page.goto(opened.url)
        opened.wait_ready()
        assert page.text_content("h1") == f"KV heads of {SCRIPT}"
        grid = page.evaluate("document.querySelector('.probe-kv-map').data[0]")
        for row in payload["kv_heads"]:
            assert grid["z"][row["layer"]][row["kv_head"]] == (1 if row["label"] == "full" else 0)
            assert f"retrieval {row['retrieval']:.3f}" in grid["text"][row["layer"]][row["kv_head"]]
        lines = page.evaluate("document.querySelector('.probe-curve-needle').data.map(d => [d.name, d.y])")
        assert [name for name, _ in lines] == ["probe's order", "random 0"]
        assert lines[0][1] == payload["curve"]["orders"]["probe"]["needle_accuracy"]
        screenshot(opened, "kv_heads.png")
        opened.check_clean()
    finally:
        context.close()


@pytest.mark.parametrize("n, start, block, sink, recent", [(300, 0, 300, 4, 64), (300, 128, 100, 4, 64),
                                                           (300, 0, 40, 4, 64), (200, 50, 150, 0, 7)])
def test_streaming_score_equals_the_masked_mass_by_hand(n: int, start: int, block: int, sink: int,
                                                        recent: int) -> None:
    """Blocks of a padded batch: the strided band sum equals the sum over a hand-built sink + recent mask."""
    from probe.heads.scores import Batch, streaming_score

    weights = torch.rand(2, 3, block, n, generator=torch.Generator().manual_seed(n + start))
    valid = torch.ones(2, n, dtype=torch.bool)
    valid[1, 150:] = False
    sums, counts = streaming_score(weights, start, Batch(valid, 1, None), sink=sink, recent=recent)
    expected, count = torch.zeros(3, dtype=torch.float64), 0
    for row in range(2):
        for q in range(block):
            i = start + q
            if i < sink + recent or not valid[row, i]:
                continue
            keys = [j for j in range(n) if j <= i and (j < sink or j > i - recent)]
            expected += weights[row, :, q, keys].sum(dim=-1).double()
            count += 1
    assert torch.allclose(sums, expected, atol=1e-4) and counts.tolist() == [count] * 3

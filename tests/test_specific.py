"""Issue 12, "small average, sharp specific": resample ablation, task sets and metrics, per-token effects."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import run_cli, tiny_loaded
from planted import HEAD_DIM, IND, ONE
from test_ablate import planted_loaded, projection, weights_zeroed

from probe.ablation import sweep
from probe.ablation.methods import ResampleAblation
from probe.hooks.run import logits_of, run_model
from probe.inputs import ProbeSet, repeated_set
from probe.errors import ProbeError
from probe.models import LoadedModel
from probe.inputs import TASKS, TaskItem, task_items, task_set
from words import PROMPTS, SENTENCES, tiny_with_words


def swapped_loss(model: torch.nn.Module, ids: torch.Tensor, head: tuple[int, int], head_dim: int,
                 donors: torch.Tensor, source: torch.Tensor | None = None) -> float:
    """Mean next-token loss with `head`'s slice of the output projection's input taken from the donor rows of an
    unablated run (of `source`, default `ids` themselves): a plain pre-hook, written independently of probe's
    editor."""
    layer, index = head
    module, _ = projection(model, layer)
    columns = slice(index * head_dim, (index + 1) * head_dim)
    seen: dict[str, torch.Tensor] = {}
    handle = module.register_forward_pre_hook(lambda _m, args: seen.__setitem__("x", args[0].detach().clone()))
    with torch.no_grad():
        run_model(model, ids if source is None else source)
    handle.remove()

    def swap(_module, args):
        x = args[0].clone()
        x[..., columns] = seen["x"][donors][..., columns]
        return (x,)

    handle = module.register_forward_pre_hook(swap)
    try:
        with torch.no_grad():
            out = logits_of(run_model(model, ids)).float()
    finally:
        handle.remove()
    return float(F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), ids[:, 1:].reshape(-1)))


def test_resample_ablation_equals_a_hand_written_swap() -> None:
    loaded = tiny_loaded("llama_gqa")
    probe_set = repeated_set(loaded, repeat_len=7, num_seqs=4)
    exact = sweep(loaded, probe_set, method="resample", batch_size=4)
    naive = sweep(loaded, probe_set, method="resample", mode="naive", batch_size=4)
    donors = ResampleAblation().donors_of(0, 4)
    assert sorted(donors.tolist()) == [0, 1, 2, 3] and all(int(d) != i for i, d in enumerate(donors))
    assert "donor of each sequence " + " ".join(str(int(d)) for d in donors) in exact.mean
    head_dim = loaded.model.config.hidden_size // loaded.model.config.num_attention_heads
    for mine, reference in zip(exact.results, naive.results):
        expected = swapped_loss(loaded.model, probe_set.input_ids, mine.heads[0], head_dim, donors)
        assert mine.loss == torch.tensor(expected).item() or abs(mine.loss - expected) < 1e-5
        assert abs(reference.loss - expected) < 1e-5
    assert exact.to_dict()["method"] == "resample" and "seed 0" in exact.to_dict()["mean"]


# ---------------------------------------------------------------------------------------------------------------
# per-token effects


def per_token_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = logits_of(run_model(model, ids)).float()
    return F.cross_entropy(out[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").double()  # (rows, n - 1)


def test_per_token_effects_equal_a_naive_per_head_computation() -> None:
    loaded = tiny_loaded("llama_gqa")
    probe_set = repeated_set(loaded, repeat_len=20, num_seqs=5)
    result = sweep(loaded, probe_set, batch_size=2, stack=3)
    ids, model = probe_set.input_ids, loaded.model
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    base = per_token_loss(model, ids)
    for entry in result.heads:
        with weights_zeroed(model, [entry.heads[0]], head_dim):
            deltas = per_token_loss(model, ids) - base  # (rows, n - 1)
        effects = entry.effects
        assert effects["mean_delta"] == pytest.approx(float(deltas.mean()), abs=1e-5)
        assert effects["mean_delta"] == pytest.approx(entry.delta, abs=1e-5)
        assert effects["max_sequence_delta"] == pytest.approx(float(deltas.mean(dim=1).max()), abs=1e-5)
        assert effects["max_token_delta"] == pytest.approx(float(deltas.max()), abs=1e-5)
        assert effects["p99_token_delta"] == pytest.approx(float(torch.quantile(deltas.flatten(), 0.99)), abs=1e-5)
        top = effects["top_tokens"][0]
        assert deltas[top["sequence"], top["position"] - 1] == pytest.approx(top["delta"], abs=1e-5)
        assert top["context"].endswith(f"[{int(ids[top['sequence'], top['position']])}]")


def planted_specific() -> LoadedModel:
    """The planted model with head 1.0 rewritten into a broad helper: attending evenly, it adds 1 to the logits of
    tokens 0-29 at every position, so that ablating it raises the loss a little on every token of text drawn from
    those tokens. The induction head 1.1 matters only where a token repeats."""
    loaded = planted_loaded()
    attention = loaded.model.layers[1]
    rows = slice(0, HEAD_DIM)
    with torch.no_grad():
        for name in ("W_q", "W_k", "W_v"):
            getattr(attention, name).weight[rows] = 0
        attention.W_o.weight[:, rows] = 0
        attention.W_v.weight[0, ONE] = 1.0
        attention.W_o.weight[IND:IND + 30, 0] = 0.1  # x 10 in the unembedding: logit +1
    return loaded


def test_specificity_finds_the_head_that_matters_for_one_token_kind_and_the_mean_does_not() -> None:
    loaded = planted_specific()
    generator = torch.Generator().manual_seed(0)
    # 16 distinct tokens of 0-29, then the first two again: only the last token can be predicted by induction
    first = torch.stack([torch.randperm(30, generator=generator)[:16] for _ in range(4)])
    probe_set = ProbeSet("planted", "distinct tokens, one repeated bigram", torch.cat([first, first[:, :2]], 1), 0)
    result = sweep(loaded, probe_set, batch_size=4)
    by_mean = sorted(result.heads, key=lambda r: -r.delta)
    by_specificity = sorted(result.heads, key=lambda r: -r.effects["specificity"])
    assert by_mean[0].heads == ((1, 0),)  # the broad helper has the largest mean effect
    assert by_specificity[0].heads in (((1, 1),), ((0, 0),))  # the induction circuit is the most specific
    induction = next(r for r in result.heads if r.heads == ((1, 1),))
    broad = by_mean[0]
    assert induction.effects["max_token_delta"] > 3 * broad.effects["max_token_delta"]
    assert induction.effects["specificity"] > 0.2 > broad.effects["specificity"]
    assert all(token["position"] == 17 for token in induction.effects["top_tokens"][:4])


# ---------------------------------------------------------------------------------------------------------------
# task sets and the task metric

def words_loaded() -> LoadedModel:
    model, tokenizer = tiny_with_words()
    return LoadedModel(model=model, tokenizer=tokenizer, name="tiny-words", vocab_size=len(tokenizer))


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def hand_margins(loaded: LoadedModel) -> tuple[list[float], list[float]]:
    """log P(good) - log P(bad) of SENTENCES (whole sentences after BOS) and logit differences of PROMPTS."""
    tok, model = loaded.tokenizer, loaded.model

    def logits(text: str) -> torch.Tensor:
        ids = torch.tensor([[0] + tok(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            return ids, logits_of(run_model(model, ids))[0].double()

    def sentence(text: str) -> float:
        ids, out = logits(text)
        return float(out[:-1].log_softmax(-1).gather(1, ids[0, 1:, None]).sum())

    sentences = [sentence(good) - sentence(bad) for good, bad in SENTENCES]
    prompts = []
    for prompt, answer, distractor in PROMPTS:
        _, out = logits(prompt)
        answer_id, distractor_id = (tok(w, add_special_tokens=False)["input_ids"][0] for w in (answer, distractor))
        prompts.append(float(out[-1, answer_id] - out[-1, distractor_id]))
    return sentences, prompts


def test_the_task_metric_equals_a_hand_computation(tmp_path: Path) -> None:
    loaded = words_loaded()
    pairs = write_rows(tmp_path / "pairs.jsonl", [{"sentence_good": g, "sentence_bad": b} for g, b in SENTENCES])
    prompts = write_rows(tmp_path / "prompts.jsonl",
                         [{"prompt": p, "answer": a, "distractor": d} for p, a, d in PROMPTS])
    sentences, logit_diffs = hand_margins(loaded)
    for path, margins in ((pairs, sentences), (prompts, logit_diffs)):
        result = sweep(loaded, task_set(loaded, path), [(0, 1), (1, 2)], batch_size=3)
        assert result.metric == "task_margin"
        assert result.task["margin"] == pytest.approx(sum(margins) / len(margins), abs=1e-4)
        assert result.task["accuracy"] == sum(m > 0 for m in margins) / len(margins)
        assert result.baseline_loss == pytest.approx(-result.task["margin"], abs=1e-9)
        head_dim = 16
        for entry in result.heads:
            with weights_zeroed(loaded.model, [entry.heads[0]], head_dim):
                ablated = hand_margins(loaded)[0 if path == pairs else 1]
            assert entry.task["margin"] == pytest.approx(sum(ablated) / len(ablated), abs=1e-4)
            assert entry.delta == pytest.approx(result.task["margin"] - entry.task["margin"], abs=1e-4)


def test_generated_tasks_drop_what_is_not_one_token() -> None:
    loaded = words_loaded()
    for name in ("sva", "ioi"):
        probe_set = task_set(loaded, name, count=12, seed=1)
        assert probe_set.input_ids.shape[0] == 24 and int(probe_set.scored.sum()) == 24  # one answer token a row
        good, bad = probe_set.input_ids[0], probe_set.input_ids[1]
        last = int(probe_set.attention_mask[0].sum()) - 1
        assert torch.equal(good[:last], bad[:last]) and good[last] != bad[last]
    items, _, dropped = task_items(loaded, "ioi", 4, 0)
    assert len(items) == 4 and dropped == []
    monkey = [TaskItem("When Mary and John went", answer=" Mary Ann", distractor=" John")]
    with pytest.raises(ProbeError, match="no item of task .* single-token"):
        TASKS["only_bad"] = lambda count, seed: monkey
        try:
            task_set(loaded, "only_bad")
        finally:
            del TASKS["only_bad"]


WORDS = "tests/words.py:tiny_with_words"


@pytest.mark.parametrize("rows, message", [
    (None, "holds no rows"),
    ('{"prompt": "the keys", "answer": " are"}\n', "line 1: no 'distractor'"),
    ('{"sentence_good": "the keys are"\n', "line 1 is not JSON"),
    ('["the keys", " are", " is"]\n', "a task row is a JSON object"),
    ('{"prompt": "When Mary and John went", "answer": " Mary Ann", "distractor": " John"}\n',
     "row 1: answer ' Mary Ann' is 2 tokens"),
])
def test_bad_task_files_are_one_line(rows: str | None, message: str, tmp_path: Path, capsys, monkeypatch) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(rows or "\n")
    code, _, stderr = run_cli(["ablate", "--model", WORDS, "--task", str(path), "--heads", "0.1"], capsys, monkeypatch)
    assert code == 2 and message in stderr, stderr
    assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr


def test_cli_task_run_reports_baseline_accuracy_and_specific_heads(tmp_path: Path, capsys, monkeypatch) -> None:
    out = tmp_path / "r.json"
    csv = tmp_path / "r.csv"
    code, stdout, stderr = run_cli(["ablate", "--model", WORDS, "--task", "sva", "--num-seqs", "6", "--method",
                                    "resample", "--json", str(out), "--csv", str(csv)], capsys, monkeypatch)
    assert code == 0, stderr
    payload = json.loads(out.read_text())
    assert payload["metric"] == "task_margin" and payload["data"] == "task:sva"
    assert set(payload["baseline_task"]) == {"margin", "accuracy"} and "task, unablated:" in stdout
    assert all("effects" in entry and "task_accuracy" in entry for entry in payload["heads"])
    assert "sharpest specific" in stdout
    assert "specificity" in csv.read_text().splitlines()[0]  # the header first (provenance: r.provenance.json)
    code, _, stderr = run_cli(["ablate", "--model", WORDS, "--task", "ioi", "--method", "estimate"], capsys,
                              monkeypatch)
    assert code == 2 and "estimate linearises" in stderr


def test_resample_groups_exact_equals_naive_and_a_batch_of_one_is_refused() -> None:
    loaded = tiny_loaded("llama_gqa")
    probe_set = repeated_set(loaded, repeat_len=6, num_seqs=4)
    heads, groups = [(0, 0), (1, 3)], [[(0, 1), (1, 2)]]
    exact = sweep(loaded, probe_set, heads, groups=groups, method="resample", batch_size=2, stack=3)
    naive = sweep(loaded, probe_set, heads, groups=groups, method="resample", mode="naive", batch_size=2)
    assert [r.loss for r in exact.results] == pytest.approx([r.loss for r in naive.results], abs=1e-5)
    with pytest.raises(ProbeError, match="a batch with one sequence has none"):
        sweep(loaded, probe_set, heads, method="resample", batch_size=3)


def test_the_estimate_refuses_a_task() -> None:
    from probe.ablation import estimate

    loaded = words_loaded()
    with pytest.raises(ProbeError, match="not a task's margin"):
        estimate(loaded, task_set(loaded, "ioi", count=2))
    with pytest.raises(ProbeError, match="not a task's margin"):
        sweep(loaded, task_set(loaded, "ioi", count=2), mode="estimate")

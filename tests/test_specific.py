"""Issue 12, "small average, sharp specific": resample ablation, task sets and metrics, per-token effects."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_loaded
from planted import HEAD_DIM, IND, ONE
from test_ablate import planted_loaded, projection, weights_zeroed

from probe.ablate import sweep
from probe.ablation.methods import ResampleAblation
from probe.attention import logits_of, run_model
from probe.data import ProbeSet, repeated_set
from probe.models import LoadedModel


def swapped_loss(model: torch.nn.Module, ids: torch.Tensor, head: tuple[int, int], head_dim: int,
                 donors: torch.Tensor) -> float:
    """Mean next-token loss with `head`'s slice of the output projection's input taken from the donor rows of an
    unablated run: a plain pre-hook, written independently of probe's editor."""
    layer, index = head
    module, _ = projection(model, layer)
    columns = slice(index * head_dim, (index + 1) * head_dim)
    seen: dict[str, torch.Tensor] = {}
    handle = module.register_forward_pre_hook(lambda _m, args: seen.__setitem__("x", args[0].detach().clone()))
    with torch.no_grad():
        run_model(model, ids)
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

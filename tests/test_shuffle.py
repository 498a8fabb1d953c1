"""Shuffle ablation: a head's output permuted over its own sequence's token positions, padding never a donor (the
batch's mask reaches the method through `ctx.batch`)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_loaded
from probe.ablation import ablate, sweep
from probe.ablation.methods import METHODS, build_method
from probe.errors import ProbeError
from probe.hooks.run import run_model
from probe.hooks.trace import Trace
from probe.hooks.types import BatchContext
from probe.inputs import ProbeSet
from probe.models import LoadedModel

LAYER, HEAD = 1, 2


def padded_set(loaded: LoadedModel) -> ProbeSet:
    """Five rows of random tokens, right-padded to 12: 12, 10, 8, 6 and 1 tokens."""
    ids = torch.randint(3, loaded.vocab_size, (5, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(5, 12, dtype=torch.long)
    for row, length in enumerate((12, 10, 8, 6, 1)):
        mask[row, :length] = 1
    return ProbeSet("natural", "padded", ids, 0, attention_mask=mask)


def z_of(loaded: LoadedModel, ids: torch.Tensor, mask: torch.Tensor, edit: dict) -> torch.Tensor:
    with torch.no_grad(), Trace(loaded, edit, read=["z"], layers=[LAYER],
                                batch=BatchContext.of(ids, mask, index=0)) as trace:
        run_model(loaded.model, ids, mask)
    return trace[LAYER]["z"]


def test_each_token_takes_another_tokens_output_of_its_own_sequence_and_padding_gives_none() -> None:
    loaded = tiny_loaded("llama_gqa")
    ids, mask = padded_set(loaded).batches(5)[0]
    method = build_method("shuffle", loaded, padded_set(loaded), seed=4)
    own = z_of(loaded, ids, mask, {})
    shuffled = z_of(loaded, ids, mask, {"z": {LAYER: method.writer(HEAD)}})
    others = [head for head in range(4) if head != HEAD]
    assert torch.equal(shuffled[:, :, others], own[:, :, others])  # the other heads as they were
    for row in range(5):
        tokens = int(mask[row].sum())
        mine, theirs = shuffled[row, :tokens, HEAD], own[row, :tokens, HEAD]  # (tokens, head_dim)
        assert torch.equal(shuffled[row, tokens:, HEAD], own[row, tokens:, HEAD])  # padding keeps its own
        donors = [int((theirs == value).all(dim=-1).nonzero()) for value in mine]  # each value is a token's own
        assert sorted(donors) == list(range(tokens))  # every token gives once: padding is never a donor
        if tokens > 1:
            assert all(donor != position for position, donor in enumerate(donors))  # a derangement


def test_a_sweep_by_name_is_exact_and_the_permutation_is_the_rows_own() -> None:
    """Registered: `method="shuffle"` runs in the sweep (exact equals naive); the permutation is fixed by the
    seed and the row's place in the set, so another batch size gives the same numbers; it is not zero ablation."""
    loaded = tiny_loaded("llama_gqa")
    probe_set = padded_set(loaded)
    assert METHODS["shuffle"].name == "shuffle"
    exact = sweep(loaded, probe_set, [(0, 1), (LAYER, HEAD)], method="shuffle", seed=1, batch_size=3)
    naive = sweep(loaded, probe_set, [(0, 1), (LAYER, HEAD)], method="shuffle", seed=1, batch_size=2, mode="naive")
    zero = sweep(loaded, probe_set, [(0, 1), (LAYER, HEAD)], batch_size=3)
    for mine, reference, zeroed in zip(exact.results, naive.results, zero.results):
        assert mine.loss == pytest.approx(reference.loss, abs=1e-5)
        assert mine.loss != pytest.approx(zeroed.loss, abs=1e-4)
    assert "seed 1" in (exact.mean or "")


def test_without_the_batch_it_is_refused_in_one_line() -> None:
    loaded = tiny_loaded("llama_gqa")
    ids, mask = padded_set(loaded).batches(5)[0]
    with pytest.raises(ProbeError, match="padding") as caught, torch.no_grad(), \
            ablate(loaded.model, [(LAYER, HEAD)], method="shuffle"):
        run_model(loaded.model, ids, mask)
    assert "\n" not in str(caught.value)
    with torch.no_grad(), ablate(loaded.model, [(LAYER, HEAD)], method="shuffle",
                                 batch=BatchContext.of(ids, mask)):  # given the batch, it runs
        run_model(loaded.model, ids, mask)

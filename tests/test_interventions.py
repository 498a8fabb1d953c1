"""One intervention abstraction: an ablation method is a `Trace` writer, the sweep's ablation and steering's
intervention at once; every caller (sweep, prune, `ablate()`) binds it to the batches it runs and hands it the
batch's context through the hook's `ctx.batch`."""

from __future__ import annotations

import torch
from torch import Tensor

from conftest import tiny_loaded
from probe.ablation import ablate, sweep
from probe.ablation.methods import (METHODS, AblationMethod, MethodInputs, ResampleAblation, ScaleAblation,
                                    scale_head)
from probe.ablation.prune import prune
from probe.hooks.run import logits_of, run_model
from probe.hooks.trace import Trace
from probe.hooks.types import BatchContext, HookContext
from probe.inputs import ProbeSet, repeated_set
from probe.models import LoadedModel


def padded_set(loaded: LoadedModel, rows: int = 4) -> ProbeSet:
    """Random tokens, right-padded: row r holds 12 - 2r tokens."""
    ids = torch.randint(3, loaded.vocab_size, (rows, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(rows, 12, dtype=torch.long)
    for row in range(rows):
        mask[row, 12 - 2 * row:] = 0
    return ProbeSet("natural", "padded", ids, 0, attention_mask=mask)


class Recorder(AblationMethod):
    """Zero ablation that records what it is bound to and the batch context each call sees."""

    name = "recorder"

    def __init__(self) -> None:
        self.bindings: list[list[int | None]] = []
        self.seen: list[tuple[int | None, tuple[int, ...], int]] = []  # index, rows, tokens

    def bind(self, batches: list[BatchContext]) -> None:  # type: ignore[override]
        self.bindings.append([batch.index for batch in batches])

    def replacement(self, heads: Tensor, ctx: HookContext) -> Tensor:
        assert ctx.batch is not None
        self.seen.append((ctx.batch.index, tuple(ctx.batch.rows.tolist()), int(ctx.batch.tokens(heads.shape[1]).sum())))
        return torch.zeros((), dtype=heads.dtype)


def test_the_sweep_prune_and_ablate_bind_the_method_and_hand_it_the_batch() -> None:
    loaded = tiny_loaded("llama_gqa")
    probe_set = padded_set(loaded)
    method = Recorder()
    sweep(loaded, probe_set, [(0, 1)], method=method, batch_size=3, mode="naive")
    assert method.bindings == [[0, 1]]  # bound once, to both batches, before any forward
    assert {(index, rows, tokens) for index, rows, tokens in method.seen} == {
        (0, (0, 1, 2), 12 + 10 + 8), (1, (3,), 6)}  # set-wide rows, each batch's own padding
    method.seen.clear()
    prune(loaded, probe_set, orderings=("random",), seeds=(0,), step=0.5, method=method, batch_size=3,
          eval_set=repeated_set(loaded, repeat_len=4, num_seqs=2))
    assert method.bindings[1:3] == [[0, 1], [0]]  # one bound copy per probe set: the pruned one, the held-out one
    assert {index for index, _, _ in method.seen} == {0}  # the losses are measured on the held-out set alone
    method.seen.clear()
    ids, mask = probe_set.batches(4)[0]
    with torch.no_grad(), ablate(loaded.model, [(1, 2)], method=method, batch=BatchContext.of(ids, mask)):
        run_model(loaded.model, ids, mask)
    assert method.bindings[-1] == [None] and method.seen == [(None, (0, 1, 2, 3), 12 + 10 + 8 + 6)]


def test_a_methods_writer_is_its_ablation() -> None:
    """The same object edits a `Trace` and ablates: equal logits, bit for bit, for every registered method that
    needs no statistics; `scale_head` is ScaleAblation's writer."""
    loaded = tiny_loaded("llama_gqa")
    ids, mask = padded_set(loaded).batches(4)[0]
    batch = BatchContext.of(ids, mask, index=0)
    with torch.no_grad():
        for name, kind in METHODS.items():
            if kind.statistics or kind.point != "z":
                continue
            method = kind.build(MethodInputs(seed=1, value=2.0))  # a value where the method takes one
            with Trace(loaded, {"z": {1: method.bound_to([batch]).writer([0, 2])}}, batch=batch):
                traced = logits_of(run_model(loaded.model, ids, mask))
            with ablate(loaded.model, [(1, 0), (1, 2)], method=method, batch=batch):
                ablated = logits_of(run_model(loaded.model, ids, mask))
            assert torch.equal(traced, ablated), name
        with Trace(loaded, {"z": {0: scale_head(3, 2.5)}}):
            shorthand = logits_of(run_model(loaded.model, ids, mask))
        with Trace(loaded, {"z": {0: ScaleAblation(2.5).writer(3)}}):
            written = logits_of(run_model(loaded.model, ids, mask))
    assert torch.equal(shorthand, written)


def test_prune_with_resample_runs_every_ordering_and_leaves_the_method_unbound() -> None:
    """Prune binds like the sweep: resample's donors are fixed per probe set before any forward (they were drawn
    lazily under inference mode, which the gradient pass of michel's ordering then refused)."""
    loaded = tiny_loaded("llama_gqa")
    method = ResampleAblation(seed=3)
    result = prune(loaded, repeated_set(loaded, repeat_len=4, num_seqs=4), step=0.5, seeds=(0,), method=method,
                   batch_size=2, eval_set=repeated_set(loaded, repeat_len=4, num_seqs=6, seed=1))
    assert [curve.ordering for curve in result.curves] == ["michel", "sweep", "random"]
    assert method.donors == {}  # the object given is left as it was: each run bound a copy of its own

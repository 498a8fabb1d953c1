"""The runs of a sweep: its plan (batches, chunks of ablations with one start block each, copies to stack, chunks per
process) and its runner, `sums(chunk, index)`: the metric sums of a chunk of ablations (stacked copies) on one batch,
run from the baseline's kept block outputs where it can, checked against the naive way on its first reuse."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from probe.ablation.blocks import (CHECK_TOLERANCE, WORK_UNITS, Blocks, Final, NoPrefix, Readout, capture,
                                   forward_costs, skip_blocks, stack)
from probe.ablation.heads import Ablation
from probe.ablation.methods import METHODS, AblationMethod, ablated
from probe.ablation.metrics import Scorer
from probe.hooks.run import Source, logits_of, run_model
from probe.hooks.types import BatchContext
from probe.inputs import ProbeSet, real_tokens
from probe.errors import ProbeError
from probe.overflow import not_finite
from probe.progress import Progress

CACHE_BYTES = 4 << 30  # kept block outputs of the baseline; beyond this they are recomputed per layer


@dataclass
class Work:
    """Progress counted in what a run costs (`scale` per unit; the sweep's and the estimate's: forward_costs), so that
    the time left follows the work left: `total` is an upper bound until what runs is known."""

    total: float
    progress: Progress | None
    scale: float = 1.0
    done: float = 0.0

    def advance(self, amount: float) -> None:
        self.done += amount
        self.report()

    def report(self) -> None:
        if self.progress is not None:
            total = max(1, round(self.total * self.scale))
            self.progress(min(round(self.done * self.scale), total), total)


def check_probe_set(probe_set: ProbeSet, method: type[AblationMethod] | None = None, refuse: str | None = None) -> None:
    """A next token to predict: at least one sequence of at least 2 tokens. Source/target pairs, whose encoder reads
    its own sources, run no `method` that reads other sequences' values, nor `refuse` (prune, the estimate)."""
    ids = probe_set.input_ids
    if ids.dim() != 2 or ids.shape[1] < 2 or ids.shape[0] < 1:
        raise ProbeError("the probe data needs at least one sequence of at least 2 tokens (a next token to predict)")
    if probe_set.source_ids is not None and refuse is not None:
        raise ProbeError(f"source/target pairs are swept (zero or window ablation), not run through {refuse}: its "
                         "passes do not give the encoder its own sources", parameter="method")
    if probe_set.source_ids is not None and method is not None and method.across_sequences:
        usable = [name for name, entry in METHODS.items() if not entry.across_sequences]
        raise ProbeError(f"source/target pairs are swept with method {' or '.join(usable)}, not {method.name}: their "
                         "encoder reads positions of its own", parameter="method")


def data_name(probe_set: ProbeSet, data: str | Path | None) -> str:
    """What a result names its data: repeated, natural, the text file, the seq2seq or the labels file."""
    if probe_set.name in ("seq2seq", "labels"):
        return str(probe_set.meta.get("source", probe_set.name))
    if probe_set.name == "repeated" or probe_set.name.startswith("task:"):
        return probe_set.name
    return "natural" if data is None else str(data)


def chunks(ablations: Sequence[Ablation], start_of: Callable[[Ablation], int], stack: int) -> list[list[Ablation]]:
    """Ablations that start in the same block, in groups of at most `stack`, split evenly."""
    groups: dict[int, list[Ablation]] = {}
    for ablation in ablations:
        groups.setdefault(start_of(ablation), []).append(ablation)
    out: list[list[Ablation]] = []
    for start in sorted(groups):
        items = groups[start]
        n = math.ceil(len(items) / stack)
        size = math.ceil(len(items) / n)
        out.extend(items[i:i + size] for i in range(0, len(items), size))
    return out


def assign_chunks(costs: Sequence[float], world_size: int) -> list[int]:
    """The rank of each chunk, largest first to the least-loaded rank: every process computes the same split."""
    if world_size < 1:
        raise ProbeError(f"world size must be at least 1, got {world_size}")
    load = [0.0] * world_size
    owner = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[index] = rank
        load[rank] += costs[index]
    return owner


NAIVE = "naive: one full forward per ablation"
EXACT = "exact: baseline prefix reused, ablated runs start at the ablated layer's block"


@dataclass
class Batch:
    """One batch of the probe set and what the ablated runs reuse of its unablated baseline."""

    ids: Tensor  # (batch, positions)
    mask: Tensor | None
    counted: Tensor  # (parts + 1, batch, positions') which positions count (Scorer.masks)
    reference: Tensor | None = None  # unablated final outputs, for metrics that compare to them
    kept: dict[int, Any] | None = None  # unablated block outputs (None: recomputed when needed)
    source: Source | None = None  # an encoder-decoder's own encoder input (probe.inputs.pairs); None: the ids
    context: BatchContext | None = None  # which batch of the set, its rows and padding: the methods' `ctx.batch`


def batch_contexts(probe_set: ProbeSet, batch_size: int) -> list[BatchContext]:
    """What a method sees of each batch of `probe_set.batches(batch_size)` (`ctx.batch`), for every caller."""
    contexts, first = [], 0
    for index, (ids, mask) in enumerate(probe_set.batches(batch_size)):
        contexts.append(BatchContext.of(ids, mask, index, first))
        first += int(ids.shape[0])
    return contexts


def batches_of(probe_set: ProbeSet, scorer: Scorer, batch_size: int) -> list[Batch]:
    """The probe set's batches, each with what its metric counts, its encoder's sources and its context."""
    return [Batch(ids, mask, scorer.masks(ids, mask, rows), source=source, context=context)
            for (ids, mask), rows, source, context in
            zip(probe_set.batches(batch_size), probe_set.scored_batches(batch_size), probe_set.sources(batch_size),
                batch_contexts(probe_set, batch_size))]


def _baseline_sums(scorer: Scorer, batch: Batch, output: Tensor | Final) -> Tensor:
    if scorer.metric.compares:  # the distance of the baseline to itself is 0
        batch.reference = output.detach()  # type: ignore[union-attr]
        return torch.zeros(len(scorer.parts) + 1, dtype=torch.float64)
    return scorer.sums(output, batch.ids, batch.counted, 1)[0]


class Runner:
    """Ablated runs from the baseline's kept `blocks` outputs, or the naive way, one full forward per ablation, where
    `reason` says why (no blocks, or a failed check). It holds the method bound to its batches (`bound_to`)."""

    def __init__(self, model: nn.Module, method: AblationMethod, scorer: Scorer, readout: Readout,
                 batches: list[Batch], blocks: Blocks | None = None, why: str = "", ablations: Sequence[Ablation] = (),
                 tokens: int = 0, checked: bool = False) -> None:
        """`tokens`: of the whole probe set (what keeping the block outputs costs); `checked`: no self-check."""
        self.model, self.scorer, self.readout, self.batches = model, scorer, readout, batches
        self.method = method.bound_to([batch.context for batch in batches if batch.context is not None])
        self.blocks, self.checked = blocks, checked
        self.reason: str | None = None if blocks is not None else why  # why it runs the naive way
        self.last = max((self.start_of(ablation) for ablation in ablations), default=0)  # blocks before it are kept
        hidden = getattr(getattr(self.model, "config", None), "hidden_size", None) or 1024
        self.keep_all = tokens * 4 * hidden * self.last <= CACHE_BYTES
        fraction = forward_costs(model, blocks)  # progress counts WORK_UNITS a full forward
        self.costs = [max(1, round(WORK_UNITS * fraction(start))) for start in range(len(blocks) if blocks else 1)]

    @property
    def path(self) -> str:
        return EXACT if self.reason is None else f"{NAIVE} ({self.reason})" if self.reason else NAIVE

    def cost(self, chunk: Sequence[Ablation] | None = None) -> int:
        """A chunk's runs on one batch (None: the baseline's) in progress units, WORK_UNITS a full forward."""
        return self.costs[0] if chunk is None else len(chunk) * self.costs[self.start_of(chunk[0])]

    def start_of(self, ablation: Ablation) -> int:
        """The first block an ablated run of `ablation` runs."""
        if self.reason is not None or self.blocks is None:
            return 0
        return min(self.blocks.start_of(layer) for layer, _ in ablation)

    def baseline(self, index: int) -> Tensor:
        """(parts + 1,) unablated metric sums of batch `index`; keeps what the ablated runs reuse."""
        batch = self.batches[index]
        if self.reason is None and self.keep_all:
            try:
                return _baseline_sums(self.scorer, batch, self._baseline_output(batch))
            except NoPrefix as error:
                self.reason, self.keep_all = str(error), False
        return _baseline_sums(self.scorer, batch, self.readout.forward(batch.ids, batch.mask, source=batch.source))

    def forward(self, ablation: Ablation, index: int, lean: bool | None = None) -> Tensor | Final:
        """One full forward of batch `index` with `ablation` ablated."""
        batch = self.batches[index]
        with ablated(self.model, [ablation], self.method, batch.context):
            return self.readout.forward(batch.ids, batch.mask, lean, batch.source)

    def naive_sums(self, chunk: list[Ablation], index: int) -> Tensor:
        """(copies, parts + 1) metric sums of each ablation of `chunk` on batch `index`, one full forward each."""
        batch = self.batches[index]
        out = torch.zeros(len(chunk), len(self.scorer.parts) + 1, dtype=torch.float64)
        for position, ablation in enumerate(chunk):
            output = self.forward(ablation, index)
            out[position] += self.scorer.sums(output, batch.ids, batch.counted, 1, batch.reference)[0]
        return out

    def _baseline_output(self, batch: Batch) -> Tensor | Final:
        """The baseline forward that keeps the blocks' outputs (and settles the direct head)."""
        model, readout, blocks = self.model, self.readout, self.blocks
        assert blocks is not None  # the exact path runs with blocks only
        lean = readout.lean(batch.ids)
        with readout.watching():
            output, kept = capture(blocks, model, batch.ids, batch.mask, logits=not lean)
        if lean:  # long context: the logits a chunk of positions at a time, from the last block's output
            output = Final(model, blocks, batch.ids, batch.mask, kept[len(blocks) - 1])
        readout.settle(output)
        batch.kept = {i: value for i, value in kept.items() if i < self.last}
        return output if isinstance(output, Final) else logits_of(output)

    def sums(self, chunk: list[Ablation], index: int) -> Tensor:
        """(copies, parts + 1) metric sums of each ablation of `chunk` on batch `index`."""
        if self.reason is not None:
            return self.naive_sums(chunk, index)
        start = self.start_of(chunk[0])
        if self.checked or start == 0:  # a chunk that starts at block 0 reuses nothing: nothing to check
            output = self._forward(chunk, index, start)
        else:
            try:
                output = self._forward(chunk, index, start)
                reason = self._check(chunk[0], index, output, len(chunk))
            except (ProbeError, KeyboardInterrupt):
                raise
            except Exception as error:  # the model cannot run from kept block outputs
                reason = f"{type(error).__name__}: {error}".splitlines()[0]
            self.checked = True
            if reason:  # start over the naive way; nothing of this chunk was counted yet
                self.reason = f"the exact path failed its check: {reason}"
                return self.naive_sums(chunk, index)
        batch = self.batches[index]
        return self.scorer.sums(output, batch.ids, batch.counted, len(chunk), batch.reference)

    def _forward(self, chunk: list[Ablation], index: int, start: int) -> Tensor | Final:
        """The chunk's ablations stacked along the batch, blocks before `start` replaced by the baseline's outputs."""
        batch, model, blocks = self.batches[index], self.model, self.blocks
        assert blocks is not None
        kept = batch.kept
        if kept is None:  # not kept (too big): run the baseline again, up to the block where this chunk starts
            _, kept = capture(blocks, model, batch.ids, batch.mask, stop_at=start)
        copies, rows = len(chunk), batch.ids.shape[0]
        # every skipped block returns the last one's output: only that one feeds the first block that runs
        entry = stack(kept[start - 1], copies, rows, batch.ids.shape[1]) if start > 0 else None
        stacked_ids = batch.ids.repeat(copies, 1)  # (copies * batch, positions)
        stacked_mask = None if batch.mask is None else batch.mask.repeat(copies, 1)
        with skip_blocks(blocks.container, {i: entry for i in range(start)}), \
                ablated(model, chunk, self.method, batch.context):
            return self.readout.stacked(blocks, stacked_ids, stacked_mask)

    def _check(self, ablation: Ablation, index: int, stacked: Tensor | Final, copies: int) -> str:
        """'' if the first copy equals a full forward with the same ablation, else what differs."""
        batch = self.batches[index]
        rows = batch.ids.shape[0]
        if isinstance(stacked, Final):  # long context: compare the last block's outputs, which make the logits
            reference_final = self.forward(ablation, index, lean=True)
            assert isinstance(reference_final, Final)
            mine, reference = stacked.first_rows(rows), reference_final.first_rows(rows)
        else:
            reference = self.forward(ablation, index, lean=False)  # type: ignore[assignment]
            mine = stacked.reshape(copies, rows, *stacked.shape[1:])[0]
        if mine.shape != reference.shape:
            return f"output shape {tuple(mine.shape)} != {tuple(reference.shape)}"
        # per position where the output has positions; a classifier's (batch, classes) whole
        valid = real_tokens(batch.ids, batch.mask) if mine.dim() > 2 else torch.ones_like(mine, dtype=torch.bool)
        valid = valid.to(mine.device)
        diff = (mine.float() - reference.float()).abs()[valid].max().item()
        scale = max(1.0, reference.float().abs()[valid].max().item())
        if not diff <= CHECK_TOLERANCE * scale:
            return f"max difference {diff:.3g} on outputs of scale {scale:.3g}"
        return ""

    def reproduces(self, index: int, expected: Tensor) -> str:
        """'' if short-circuiting the blocks before the last reproduces the baseline's sums on batch `index`."""
        batch, blocks = self.batches[index], self.blocks
        if batch.kept is None or blocks is None:
            return "no block outputs kept"
        skipped = {i: value for i, value in batch.kept.items() if i < len(blocks) - 1}
        with torch.no_grad(), skip_blocks(blocks.container, skipped):
            output = logits_of(run_model(self.model, batch.ids, batch.mask))
        mine = self.scorer.sums(output, batch.ids, batch.counted, 1)[0]
        scale = float(expected.abs().max().clamp(min=1.0))
        difference = float((mine - expected).abs().max())
        return "" if difference <= CHECK_TOLERANCE * scale else f"metric differs by {difference:.3g}"


def require_finite_baseline(runner: Runner, loss: float) -> None:
    """Refuse a NaN or infinite baseline (probe.overflow): every ablated run would be measured against it."""
    references = [batch.reference for batch in runner.batches if isinstance(batch.reference, Tensor)]
    finite = math.isfinite(loss)
    if finite and references:
        finite = bool(torch.stack([torch.isfinite(reference).all() for reference in references]).all())
    if not finite:
        raise not_finite(f"the unablated model's {runner.scorer.metric.name}", runner.model,
                         [partial(run_model, runner.model, batch.ids, batch.mask, source=batch.source)
                          for batch in runner.batches])

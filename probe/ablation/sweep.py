"""`sweep`: one result per head (or group of heads ablated together), each against the unablated baseline. `mode`:
"naive" (one full forward per ablation, the reference), "exact" (the baseline's prefix reused, stacked copies;
checked against naive on the first reuse, falling back if they differ), "estimate" (attribution patching). Results
stream to a JSON-lines file; `resume=True` skips what it holds. The model is restored exactly on exit."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from probe.ablation.blocks import Readout, find_blocks
from probe.ablation.estimate import estimate
from probe.ablation.heads import Ablation, Head, ablation_list, layer_shape
from probe.ablation.methods import AblationMethod, ZeroAblation, build_method, method_class
from probe.ablation.metrics import Metric, Scorer, choose_metric, losses, parts_of
from probe.ablation.results import AblationResult, HeadResult
from probe.ablation.statistics import HeadStatistics
from probe.ablation.runners import (Runner, Work, assign_chunks, batches_of, check_probe_set, chunks, data_name,
                                    require_finite_baseline)
from probe.ablation.stream import RESULTS_FORMAT, LineStream, check_same_sweep, fingerprint, result_of, sweep_stream
from probe.hooks.layers import attention_layers
from probe.inputs import ProbeSet, real_tokens
from probe.errors import ProbeError
from probe.hooks.stacks import layer_names
from probe.models import LoadedModel
from probe.progress import ProgressArg, callback, log, reports
from probe.provenance import model_dtype, model_facts

MODES = ("exact", "naive", "estimate")


def _validate(probe_set: ProbeSet, method: str | AblationMethod, mode: str, stack: int | None,
              groups: Sequence[Sequence[Head]]) -> None:
    chosen = method_class(method)
    if mode not in MODES:
        raise ProbeError(f"unknown sweep mode {mode!r}: use one of {', '.join(MODES)}", parameter="mode")
    check_probe_set(probe_set, None if mode == "estimate" else chosen)  # the estimate checks the sources itself
    if stack is not None and stack < 1:
        raise ProbeError(f"stack must be at least 1, got {stack}", parameter="stack")
    if mode == "estimate" and (not chosen.estimable or groups):
        raise ProbeError("mode 'estimate' linearises single-head ablations of a method it can linearise (zero): use "
                         "method 'zero' and no groups", parameter="mode")


def sweep_runner(loaded: LoadedModel, probe_set: ProbeSet, mode: str, method: AblationMethod, metric: Metric,
                 batch_size: int, ablations: list[Ablation]) -> Runner:
    """The runner of this sweep: prefix reuse where the model has a block list."""
    model = loaded.model
    scorer = Scorer(metric, parts_of(probe_set))
    blocks, why_not = (None, "") if mode == "naive" else find_blocks(model, attention_layers(model))
    return Runner(model, method, scorer, Readout.choose(model, metric.chunkable, blocks), batches_of(
        probe_set, scorer, batch_size), blocks, why_not, ablations, int(probe_set.input_ids.numel()))


TOP_TOKENS = 5  # affected tokens kept per ablation
CONTEXT = 6  # tokens of context before an affected token
TOP_SHARE = 0.01  # specificity: the share of the loss increase carried by this fraction of the tokens


def specificity(deltas: Tensor) -> float:
    """The share of the positive per-token deltas' sum held by the top TOP_SHARE of all tokens (0 if none)."""
    positive = deltas.clamp(min=0)
    total = float(positive.sum())
    if total <= 0:
        return 0.0
    k = max(1, math.ceil(TOP_SHARE * deltas.numel()))
    return float(positive.topk(min(k, positive.numel())).values.sum()) / total


class _Baseline:
    """The unablated model's metric, which each ablation's is compared to, and its per-position values, which give each
    ablation's per-token and per-sequence effects: mean delta, largest per-sequence delta, 99th percentile and maximum
    per-token delta, top affected tokens with context, and specificity, the share of a head's loss increase its top 1%
    of tokens carry (about 0.01 when even, 1 when one token takes it all; Olsson et al. 2022 read effects token by
    token). A chunk's values live until it finishes."""

    def __init__(self, runner: Runner, sums: Tensor, values: list[Tensor], tokenizer: Any) -> None:
        """`sums`: (parts + 1,) the metric's; values[i]: (batch_i, positions') batch i's per-position values."""
        batches, self.metric, self.tokenizer, self.values = runner.batches, runner.scorer.metric, tokenizer, values
        self.ids, self.counted = [batch.ids for batch in batches], [batch.counted[0].cpu() for batch in batches]
        self.signs = self.metric.signs(sum(int(ids.shape[0]) for ids in self.ids))  # -1 for a task's bad rows
        self.per_row = [real_tokens(b.ids, b.mask).sum(dim=1) for b in batches] if self.metric.per_row else None
        self.starts = [0]
        for ids in self.ids[:-1]:
            self.starts.append(self.starts[-1] + int(ids.shape[0]))
        self.counts = torch.stack([batch.counted.sum(dim=(1, 2)) for batch in batches]).sum(dim=0).double()
        self.loss, self.parts = losses(sums, self.counts, list(runner.scorer.parts))
        finished = self.metric.finish(self.row_sums([b[None] for b in values])[0])
        self.task = None if finished is None else finished[1]  # task sets: margin and accuracy
        if finished is not None:
            self.loss = finished[0]

    def row_sums(self, values: list[Tensor]) -> Tensor:
        """(copies, rows) float64 sums over each sequence's counted positions; values[i] (copies, batch_i, pos')."""
        return torch.cat([(v.double() * c.to(v.device)).sum(dim=-1).cpu() for v, c in zip(values, self.counted)],
                         dim=1)

    def results(self, chunk: list[Ablation], sums: Tensor, values: list[Tensor]) -> list[HeadResult]:
        """A finished chunk's results from its (copies, parts + 1) sums and per batch its (copies, batch, positions')
        values."""
        rows = self.row_sums(values)  # (copies, rows)
        out = []
        for copy, (ablation, summary) in enumerate(zip(chunk, self.summarize(values))):
            finished = self.metric.finish(rows[copy])
            result = HeadResult.of_sums(ablation, sums[copy], self.counts, self.loss, self.parts)
            if finished is not None:  # a metric of its own (task sets): loss from the per-sequence sums
                result.loss, result.task = finished
                result.delta = result.loss - self.loss
            result.effects = summary
            out.append(result)
        return out

    def summarize(self, values: list[Tensor]) -> list[dict[str, Any]]:
        """One summary per copy of the chunk; values[i] (copies, batch_i, positions') of batch i."""
        deltas = [(v.float().cpu() - b[None]) for v, b in zip(values, self.values)]  # per batch
        if self.signs is not None:
            deltas = [d * self.signs[start:start + d.shape[1], None].float() for d, start in zip(deltas, self.starts)]
        counts = torch.cat([c.sum(dim=-1) for c in self.counted]).double()  # (rows,)
        rows = self.row_sums(deltas) / counts.clamp(min=1)  # (copies, rows) mean delta per sequence
        flat = torch.cat([d[:, c] for d, c in zip(deltas, self.counted)], dim=1).double()  # (copies, tokens)
        where = torch.cat([c.nonzero() + torch.tensor([start, 0]) for c, start in zip(self.counted, self.starts)])
        return [self._summary(flat[copy], rows[copy], where) for copy in range(flat.shape[0])]

    def _summary(self, deltas: Tensor, rows: Tensor, where: Tensor) -> dict[str, Any]:
        """deltas (tokens,) of the counted tokens, at (row, position') `where`; rows (rows,) per-sequence deltas."""
        if deltas.numel() == 0:
            return {}
        top = deltas.topk(min(TOP_TOKENS, deltas.numel()))
        return {
            "mean_delta": float(deltas.mean()),
            "max_sequence_delta": float(rows.max()),
            "p99_token_delta": float(torch.quantile(deltas, 0.99)),
            "max_token_delta": float(top.values[0]),
            "specificity": specificity(deltas),
            "top_tokens": [self._token(int(where[i, 0]), int(where[i, 1]), float(value))
                           for value, i in zip(top.values, top.indices)],
        }

    def _token(self, row: int, position: int, delta: float) -> dict[str, Any]:
        batch = max(i for i, start in enumerate(self.starts) if start <= row)
        ids = self.ids[batch][row - self.starts[batch]]
        if self.per_row is not None:  # `position` is the gold class: the context is the sequence's beginning
            first = min(2 * CONTEXT, int(self.per_row[batch][row - self.starts[batch]]) - 1)
            return {"sequence": row, "position": 0, "class": position, "delta": delta,
                    "context": self._context(ids, first, first)}
        token = position + self.metric.shift  # the token whose prediction (or output) changed
        return {"sequence": row, "position": token, "delta": delta, "context": self._context(ids, token, CONTEXT)}

    def _context(self, ids: Tensor, position: int, context: int) -> str:
        """The `context` tokens before `position` and its token [bracketed], in words (ids without a tokenizer)."""
        before, token = ids[max(0, position - context):position].tolist(), [int(ids[position])]
        if self.tokenizer is None:
            return " ".join(map(str, before)) + f" [{token[0]}]"
        return self.tokenizer.decode(before) + "[" + self.tokenizer.decode(token) + "]"


def _baseline(runner: Runner, work: Work, tokenizer: Any) -> _Baseline:
    """The unablated model's metric over the probe set, its per-position values kept for the per-token effects."""
    scorer = runner.scorer
    sums = torch.zeros(len(scorer.parts) + 1, dtype=torch.float64)
    values = []
    with torch.inference_mode():
        for index, batch in enumerate(runner.batches):
            scorer.keep = []
            sums += runner.baseline(index)
            # a metric that compares to the baseline is 0 on it (and is not computed)
            values.append(scorer.keep[0][0] if scorer.keep else torch.zeros(batch.counted.shape[1:]))
            work.advance(runner.cost())
    scorer.keep = None
    base = _Baseline(runner, sums, values, tokenizer)
    require_finite_baseline(runner, base.loss)
    return base


def baseline_metric(loaded: LoadedModel, probe_set: ProbeSet, *, metric: str | Metric | None = None,
                    batch_size: int = 8) -> tuple[float, dict[str, float] | None]:
    """The unablated model's metric over a probe set as a sweep's baseline measures it (and a task's figures)."""
    chosen = choose_metric(loaded, probe_set, metric)
    runner = sweep_runner(loaded, probe_set, "naive", ZeroAblation(), chosen, batch_size, [])
    base = _baseline(runner, Work(0, None), loaded.tokenizer)
    return base.loss, base.task


def _header(loaded: LoadedModel, probe_set: ProbeSet, method: AblationMethod, metric: str, data: str,
            baseline: tuple[float, dict[str, float]]) -> dict[str, Any]:
    """The results stream's first line: what the sweep is, so that a resumed one can tell it is the same."""
    layers = attention_layers(loaded.model)
    n_layers, n_heads = layer_shape(layers)
    names = layer_names(layers)
    return {"probe_ablation": RESULTS_FORMAT, "model": loaded.name, "method": method.name, "data": data,
            "metric": metric, "fingerprint": fingerprint(loaded, probe_set, method, metric),
            "baseline_loss": baseline[0], "baseline_parts": baseline[1], "n_layers": n_layers, "n_heads": n_heads,
            "mean": method.describe(), **({"layer_names": names} if names else {}), **_identity(loaded, probe_set)}


def _identity(loaded: LoadedModel, probe_set: ProbeSet) -> dict[str, Any]:
    """The model (name and content hash), dtype and probe set of a sweep: what `resume` checks first."""
    return {"model": loaded.name, "model_sha256": model_facts(loaded).get("sha256"), "dtype": model_dtype(loaded),
            "probe_set": probe_set.to_dict() | {"description": probe_set.description}}


def _plan(runner: Runner, ablations: list[Ablation], stack: int | None, vocab_size: int,
          shard: tuple[int, int] | None) -> list[list[Ablation]]:
    """The chunks this process runs: ablations of one start block, `stack` copies at most, this shard's share."""
    if runner.reason is not None:
        stack = 1
    elif stack is None:
        stack = runner.readout.copies([batch.ids for batch in runner.batches], vocab_size)
    planned = chunks(ablations, runner.start_of, stack)
    if shard is None:
        return planned
    owner = assign_chunks([runner.cost(chunk) for chunk in planned], shard[1])
    return [chunk for chunk, rank in zip(planned, owner) if rank == shard[0]]


def _run(runner: Runner, todo: list[list[Ablation]], work: Work,
         finish: Callable[[list[Ablation], Tensor, list[Tensor]], None]) -> None:
    """Every chunk on every batch; `finish` gets each chunk, its sums and its per-position values once all are in."""
    scorer = runner.scorer
    for chunk in todo:
        sums = torch.zeros(len(chunk), len(scorer.parts) + 1, dtype=torch.float64)  # (copies, parts + 1)
        cost, values = runner.cost(chunk), []  # as planned, should the exact path fall back
        for index in range(len(runner.batches)):
            scorer.keep = []
            sums += runner.sums(chunk, index)
            values.append(torch.cat(scorer.keep))
            work.advance(cost)
        scorer.keep = None
        finish(chunk, sums, values)


class _Finished:
    """Finished ablations (those a resumed stream holds first), each streamed and handed to `on_result` once."""

    def __init__(self, stream: LineStream | None, on_result: Callable[[HeadResult], None] | None,
                 baseline: _Baseline) -> None:
        self.stream, self.on_result, self.baseline = stream, on_result, baseline
        self.done: dict[Ablation, HeadResult] = dict(stream.done) if stream is not None else {}

    def add_chunk(self, chunk: list[Ablation], sums: Tensor, values: list[Tensor]) -> None:
        for result in self.baseline.results(chunk, sums, values):
            if result.heads in self.done:
                continue
            self.done[result.heads] = result
            if self.stream is not None:
                self.stream.write(result)
            if self.on_result is not None:
                self.on_result(result)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()


def _result(runner: Runner, header: dict[str, Any], finished: _Finished, ablations: list[Ablation],
            started: float) -> AblationResult:
    return result_of(header, [finished.done[a] for a in ablations if a in finished.done], path=runner.path,
                     mode="naive" if runner.path.startswith("naive") else "exact",
                     seconds=time.perf_counter() - started)


@reports("ablating heads")
def sweep(
    loaded: LoadedModel,
    probe_set: ProbeSet,
    heads: Sequence[Head] | None = None,
    *,
    groups: Sequence[Sequence[Head]] = (),
    method: str | AblationMethod = "zero",
    metric: str | Metric | None = None,
    mode: str = "exact",
    statistics: HeadStatistics | None = None,
    seed: int = 0,
    batch_size: int = 8,
    stack: int | None = None,
    results_path: str | Path | None = None,
    resume: bool = False,
    data: str | Path | None = None,
    progress: ProgressArg = None,
    on_result: Callable[[HeadResult], None] | None = None,
    shard: tuple[int, int] | None = None,
) -> AblationResult:
    """Ablate each head of `heads` alone (default: every head) and each group of `groups` together; the metric of
    each against the unablated baseline.

    `method`: a name of METHODS (built with what it declares) or an AblationMethod; `metric`: a name of METRICS or a
    Metric (default: `choose_metric`); `mode` as the module says, `stack` ablations per forward (default: what fits
    in STACK_BYTES); `results_path` and `resume` stream and resume; `shard=(rank, world)` runs this process's share."""
    started, progress = time.perf_counter(), callback(progress)  # True: a bar on stderr
    _validate(probe_set, method, mode, stack, groups)
    ablations = ablation_list(loaded.model, heads, groups)
    if mode == "estimate":
        return estimate(loaded, probe_set, [a[0] for a in ablations], metric=metric, batch_size=batch_size, data=data,
                        progress=progress)
    chosen_metric = choose_metric(loaded, probe_set, metric)
    if resume and results_path is not None:  # before the baseline's forwards: the file holds this model's sweep
        check_same_sweep(Path(results_path), _identity(loaded, probe_set))
    chosen = build_method(method, loaded, probe_set, statistics=statistics, seed=seed, batch_size=batch_size)
    runner = sweep_runner(loaded, probe_set, mode, chosen, chosen_metric, batch_size, ablations)
    chosen = runner.method  # bound to the probe set's batches (its donors fixed before the fingerprint is taken)
    work = Work(len(runner.batches) * runner.cost() * (1 + len(ablations)), progress)
    base = _baseline(runner, work, loaded.tokenizer)
    header = _header(loaded, probe_set, chosen, chosen_metric.name, data_name(probe_set, data),
                     (base.loss, base.parts)) | {"task": base.task}
    finished = _Finished(sweep_stream(Path(results_path), header, resume) if results_path is not None else None,
                         on_result, base)  # where finished ablations go
    log.info("sweep of %d ablations: %s, baseline loss %.4f", len(ablations), runner.path, base.loss)
    planned = _plan(runner, ablations, stack, loaded.vocab_size, shard)
    todo = [chunk for chunk in planned if not all(a in finished.done for a in chunk)]
    work.total = work.done + sum(len(runner.batches) * runner.cost(chunk) for chunk in todo)
    with ExitStack() as scope:
        scope.enter_context(torch.inference_mode())  # ~2% quicker than no_grad on CPU: no version counters
        scope.callback(finished.close)
        _run(runner, todo, work, finished.add_chunk)
    return _result(runner, header, finished, ablations, started)


def sweep_units(loaded: LoadedModel, probe_set: ProbeSet, units: Sequence[Ablation],
                run: Callable[..., AblationResult | None] = sweep, **options: Any) -> AblationResult | None:
    """`run` (sweep, or a sharded one: None on a rank that does not report) over `units`, each ablated together."""
    singles = all(len(unit) == 1 for unit in units)
    return run(loaded, probe_set, [unit[0] for unit in units] if singles else [], groups=() if singles else units,
               **options)

"""`sweep`: one result per head (or group of heads ablated together), each against the unablated baseline. `mode`:
"naive" (one full forward per ablation, the reference), "exact" (the baseline's prefix reused, stacked copies;
checked against naive on the first reuse, falling back if they differ), "estimate" (attribution patching). Results
stream to a JSON-lines file; `resume=True` skips what it holds. The model is restored exactly on exit."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from probe.ablation.blocks import WORK_UNITS, find_blocks, forward_costs
from probe.ablation.effects import Effects, token_text
from probe.ablation.estimate import estimate
from probe.ablation.heads import Ablation, Head, ablation_list, layer_shape
from probe.ablation import logits as readouts
from probe.ablation.logits import Readout
from probe.ablation.methods import AblationMethod, ZeroAblation, build_method, method_class
from probe.ablation.metrics import Metric, Scorer, choose_metric, losses, parts_of
from probe.ablation.plan import Work, assign_chunks, check_probe_set, check_sources, chunks, data_name, default_stack
from probe.ablation.results import AblationResult, HeadResult
from probe.ablation.statistics import HeadStatistics
from probe.ablation.runners import NaiveRunner, PrefixRunner, batches_of, require_finite_baseline
from probe.ablation.stream import RESULTS_FORMAT, Stream, check_same_sweep, fingerprint, result_of
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
    check_probe_set(probe_set)
    if mode != "estimate":  # the estimate checks the sources itself
        check_sources(probe_set, chosen)
    if stack is not None and stack < 1:
        raise ProbeError(f"stack must be at least 1, got {stack}", parameter="stack")
    if mode == "estimate" and (not chosen.estimable or groups):
        raise ProbeError("mode 'estimate' linearises single-head ablations of a method it can linearise (zero): use "
                         "method 'zero' and no groups", parameter="mode")


def sweep_runner(loaded: LoadedModel, probe_set: ProbeSet, mode: str, method: AblationMethod, metric: Metric,
                 batch_size: int, ablations: list[Ablation]) -> tuple[NaiveRunner, Callable[[int], int]]:
    """The runner of this sweep (prefix reuse where the model has a block list) and a run's cost by start block."""
    model = loaded.model
    scorer = Scorer(metric, parts_of(probe_set))
    layers = attention_layers(model)
    blocks, why_not = (None, "") if mode == "naive" else find_blocks(model, layers)
    readout = Readout.choose(model, metric.chunkable, blocks)
    batches = batches_of(probe_set, scorer, batch_size)
    if blocks is None:
        return NaiveRunner(model, method, scorer, readout, batches, why_not), lambda start: WORK_UNITS
    fraction = forward_costs(model, blocks)  # progress counts WORK_UNITS a full forward
    costs = [max(1, round(WORK_UNITS * fraction(start))) for start in range(len(blocks))]
    tokens = int(probe_set.input_ids.numel())
    return PrefixRunner(model, method, scorer, readout, batches, blocks, ablations, tokens), costs.__getitem__


@dataclass
class _Baseline:
    """The unablated model's metric, and what each ablation is compared to."""

    loss: float
    parts: dict[str, float]
    counts: Tensor  # (parts + 1,) positions that count
    effects: Effects  # per-position values, for per-token effects
    task: dict[str, float] | None  # task sets: margin and accuracy


def _baseline(runner: NaiveRunner, work: Work, cost: Callable[[int], int], tokenizer: Any) -> _Baseline:
    """The unablated model's metric over the probe set, its per-position values kept for the per-token effects."""
    scorer = runner.scorer
    sums = torch.zeros(len(scorer.parts) + 1, dtype=torch.float64)
    counts = torch.stack([batch.counted.sum(dim=(1, 2)) for batch in runner.batches]).sum(dim=0).double()
    values = []
    with torch.inference_mode():
        for index, batch in enumerate(runner.batches):
            scorer.keep = []
            sums += runner.baseline(index)
            # a metric that compares to the baseline is 0 on it (and is not computed)
            values.append(scorer.keep[0][0] if scorer.keep else torch.zeros(batch.counted.shape[1:]))
            work.advance(cost(0))
    scorer.keep = None
    loss, parts = losses(sums, counts, list(scorer.parts))
    effects = Effects([batch.ids for batch in runner.batches], [batch.counted[0].cpu() for batch in runner.batches],
                      values, scorer.metric.shift, token_text(tokenizer), scorer.metric.signs(sum(
                          int(batch.ids.shape[0]) for batch in runner.batches)),
                      [real_tokens(b.ids, b.mask).sum(dim=1) for b in runner.batches]
                      if scorer.metric.per_row else None)
    finished = scorer.metric.finish(effects.baseline_rows())
    if finished is not None:
        loss = finished[0]
    require_finite_baseline(runner, loss)
    return _Baseline(loss, parts, counts, effects, None if finished is None else finished[1])


def baseline_metric(loaded: LoadedModel, probe_set: ProbeSet, *, metric: str | Metric | None = None,
                    batch_size: int = 8) -> tuple[float, dict[str, float] | None]:
    """The unablated model's metric over a probe set as a sweep's baseline measures it (and a task's figures)."""
    chosen = choose_metric(loaded, probe_set, metric)
    runner, cost = sweep_runner(loaded, probe_set, "naive", ZeroAblation(), chosen, batch_size, [])
    base = _baseline(runner, Work(0, None), cost, loaded.tokenizer)
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


def _plan(runner: NaiveRunner, ablations: list[Ablation], stack: int | None, vocab_size: int,
          shard: tuple[int, int] | None, cost: Callable[[int], int]) -> list[list[Ablation]]:
    """The chunks this process runs: ablations of one start block, `stack` copies at most, this shard's share."""
    if not isinstance(runner, PrefixRunner) or runner.reason is not None:
        stack = 1
    elif stack is None:
        readout = runner.readout
        inputs = [batch.ids for batch in runner.batches]
        stack = default_stack(runner.model, inputs, vocab_size, readout.chunked,
                              any(readout.lean(ids) for ids in inputs), readouts.LOGITS_BYTES)  # tests lower it
    planned = chunks(ablations, runner.start_of, stack)
    if shard is None:
        return planned
    owner = assign_chunks([len(chunk) * cost(runner.start_of(chunk[0])) for chunk in planned], shard[1])
    return [chunk for chunk, rank in zip(planned, owner) if rank == shard[0]]


def _run(runner: NaiveRunner, todo: list[list[Ablation]], work: Work, cost: Callable[[int], int],
         finish: Callable[[list[Ablation], Tensor, list[Tensor]], None]) -> None:
    """Every chunk on every batch; `finish` gets each chunk, its sums and its per-position values once all are in."""
    scorer = runner.scorer
    for chunk in todo:
        sums = torch.zeros(len(chunk), len(scorer.parts) + 1, dtype=torch.float64)  # (copies, parts + 1)
        start = runner.start_of(chunk[0])
        values = []
        for index in range(len(runner.batches)):
            scorer.keep = []
            sums += runner.sums(chunk, index)
            values.append(torch.cat(scorer.keep))
            work.advance(len(chunk) * cost(start))
        scorer.keep = None
        finish(chunk, sums, values)


class _Finished:
    """Finished ablations (those a resumed stream holds first), each streamed and handed to `on_result` once."""

    def __init__(self, stream: Stream | None, on_result: Callable[[HeadResult], None] | None, baseline: _Baseline,
                 metric: Metric) -> None:
        self.stream, self.on_result, self.baseline, self.metric = stream, on_result, baseline, metric
        self.done: dict[Ablation, HeadResult] = dict(stream.done) if stream is not None else {}

    def add_chunk(self, chunk: list[Ablation], sums: Tensor, values: list[Tensor]) -> None:
        """A finished chunk: its (copies, parts + 1) sums and per batch its (copies, batch, positions') values."""
        effects = self.baseline.effects
        rows = effects.row_sums(values)  # (copies, rows)
        for copy, (ablation, summary) in enumerate(zip(chunk, effects.summarize(values))):
            self.add(ablation, sums[copy], summary, self.metric.finish(rows[copy]))

    def add(self, ablation: Ablation, sums: Tensor, effects: dict[str, Any],
            finished: tuple[float, dict[str, float]] | None) -> None:
        if ablation in self.done:
            return
        base = self.baseline
        result = HeadResult.of_sums(ablation, sums, base.counts, base.loss, base.parts)
        if finished is not None:  # a metric of its own (task sets): loss from the per-sequence sums
            result.loss, result.task = finished
            result.delta = result.loss - base.loss
        result.effects = effects
        self.done[ablation] = result
        if self.stream is not None:
            self.stream.write(result)
        if self.on_result is not None:
            self.on_result(result)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()


def _result(runner: NaiveRunner, header: dict[str, Any], finished: _Finished, ablations: list[Ablation],
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
    runner, cost = sweep_runner(loaded, probe_set, mode, chosen, chosen_metric, batch_size, ablations)
    chosen = runner.method  # bound to the probe set's batches (its donors fixed before the fingerprint is taken)
    work = Work(len(runner.batches) * cost(0) * (1 + len(ablations)), progress)
    base = _baseline(runner, work, cost, loaded.tokenizer)
    header = _header(loaded, probe_set, chosen, chosen_metric.name, data_name(probe_set, data),
                     (base.loss, base.parts)) | {"task": base.task}
    finished = _Finished(Stream(Path(results_path), header, resume) if results_path is not None else None,
                         on_result, base, chosen_metric)  # where finished ablations go
    log.info("sweep of %d ablations: %s, baseline loss %.4f", len(ablations), runner.path, base.loss)
    planned = _plan(runner, ablations, stack, loaded.vocab_size, shard, cost)
    todo = [chunk for chunk in planned if not all(a in finished.done for a in chunk)]
    work.total = work.done + sum(len(runner.batches) * len(chunk) * cost(runner.start_of(chunk[0]))
                                 for chunk in todo)
    with ExitStack() as scope:
        scope.enter_context(torch.inference_mode())  # ~2% quicker than no_grad on CPU: no version counters
        scope.callback(finished.close)
        _run(runner, todo, work, cost, finished.add_chunk)
    return _result(runner, header, finished, ablations, started)


def sweep_units(loaded: LoadedModel, probe_set: ProbeSet, units: Sequence[Ablation],
                run: Callable[..., AblationResult | None] = sweep, **options: Any) -> AblationResult | None:
    """`run` (sweep, or a sharded one: None on a rank that does not report) over `units`, each ablated together."""
    singles = all(len(unit) == 1 for unit in units)
    return run(loaded, probe_set, [unit[0] for unit in units] if singles else [], groups=() if singles else units,
               **options)

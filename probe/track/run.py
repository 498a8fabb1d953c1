"""`track`: score every checkpoint of a training run, one model in memory at a time, each result streamed as it
finishes (a header line, then one line per checkpoint); under torchrun the checkpoints are dealt out over the
processes and rank 0 returns the merged result."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from probe.ablation import parse_heads, sweep
from probe.ablation.stream import LineStream, json_lines
from probe.heads.classify import classify
from probe.inputs import DEFAULT_NUM_SEQS, DEFAULT_REPEAT_LEN, DEFAULT_SEED, DEFAULT_SEQ_LEN, natural_set
from probe.distributed import current, gather, process_group, rank_device, shard_path, shard_paths
from probe.errors import ProbeError
from probe.heads.scores import SCORES
from probe.hooks.layers import attention_layers
from probe.models import LoadedModel, input_device, load_model
from probe.progress import Progress, ProgressArg, callback, log, reports
from probe.track.checkpoints import STATE_DICTS, Checkpoint, Run, check_run, load_checkpoints
from probe.track.icl import EARLY, ICL_SEQS, LATE, check_positions, icl_score, probe_loss
from probe.track.result import MIN_RISE, CheckpointResult, TrackResult

TRACK_FORMAT = 1
OnModel = Callable[[LoadedModel], None] | None  # each checkpoint's model once loaded (e.g. to record provenance)
OnResult = Callable[[CheckpointResult], None] | None  # each finished result


@dataclass(frozen=True)
class TrackOptions:
    """What each checkpoint is scored on: classify's options, the ICL tokens, heads to ablate, the rise that counts."""

    data: str | None = None
    seq_len: int = DEFAULT_SEQ_LEN
    num_seqs: int = DEFAULT_NUM_SEQS
    repeat_len: int = DEFAULT_REPEAT_LEN
    seed: int = DEFAULT_SEED
    thresholds: dict[str, float] = field(default_factory=dict)
    scores: tuple[str, ...] | None = None
    batch_size: int = 8
    early: int = EARLY
    late: int = LATE
    icl_seqs: int = ICL_SEQS
    heads: str = ""  # heads to ablate at every checkpoint, as parse_heads reads them ("1.2,1.3"); "": none
    min_rise: float = MIN_RISE

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure(loaded: LoadedModel, checkpoint: Checkpoint, options: TrackOptions) -> CheckpointResult:
    """One checkpoint: every head's scores, the probe-text loss, the ICL score and the chosen heads' ablation deltas."""
    result = classify(loaded, data=options.data, seq_len=options.seq_len, num_seqs=options.num_seqs,
                      repeat_len=options.repeat_len, seed=options.seed, thresholds=options.thresholds,
                      scores=None if options.scores is None else list(options.scores), batch_size=options.batch_size)
    heads = [{"layer": e["layer"], "head": e["head"], "scores": e["scores"]} for e in result.to_dict()["heads"]]
    loss = probe_loss(loaded, data=options.data, seq_len=options.seq_len, num_seqs=options.num_seqs,
                      batch_size=options.batch_size)
    icl = icl_score(loaded, early=options.early, late=options.late, data=options.data, num_seqs=options.icl_seqs,
                    batch_size=options.batch_size)
    if options.heads:
        probe_set = natural_set(loaded, data=options.data, seq_len=options.seq_len, num_seqs=options.num_seqs)
        chosen = parse_heads(options.heads, attention_layers(loaded.model))
        deltas = {entry.heads[0]: entry.delta for entry in sweep(loaded, probe_set, chosen,
                                                                  batch_size=options.batch_size).results}
        for entry in heads:
            if (entry["layer"], entry["head"]) in deltas:
                entry["delta"] = deltas[(entry["layer"], entry["head"])]
    return CheckpointResult(checkpoint.name, checkpoint.step, loss, icl.value, heads,
                            [icl.note] if icl.note else [])


def _identity(run: Run, options: TrackOptions, load_options: dict[str, Any]) -> dict[str, Any]:
    """What makes two runs' numbers comparable: not the checkpoint list, so that a run can be extended."""
    return {"kind": run.kind, "model": run.model or "", "options": options.to_dict(),
            "dtype": str(load_options.get("dtype") or "float32")}


def _score_all(run: Run, todo: list[Checkpoint], options: TrackOptions, stream: LineStream, base: LoadedModel | None,
               load_options: dict[str, Any], progress: Progress | None, hooks: tuple[OnModel, OnResult]) -> None:
    """Load, measure and stream each checkpoint of `todo` in turn; one model in memory at a time."""
    share = Run(run.kind, tuple(todo), run.model)
    done = len(stream.done)
    total = done + len(todo)
    if progress is not None:
        progress(done, total)  # the count is known before the first checkpoint loads, however long that takes
    on_model, on_result = hooks
    for checkpoint, loaded in load_checkpoints(share, base, **load_options):
        if on_model is not None:
            on_model(loaded)
        result = measure(loaded, checkpoint, options)
        del loaded  # before the next is loaded
        stream.write(result)
        log.info("track: %s (step %d) done", checkpoint.name, checkpoint.step)
        done += 1
        if on_result is not None:
            on_result(result)
        if progress is not None:
            progress(done, total)


def _result(run: Run, options: TrackOptions, results: dict[str, CheckpointResult], model: str,
            dtype: str) -> TrackResult:
    ordered = [results[c.name] for c in run.checkpoints if c.name in results]
    names = list(options.scores or [n for n, s in SCORES.items() if s.by_default])
    thresholds = {name: options.thresholds.get(name, SCORES[name].threshold) for name in names}
    return TrackResult(model=model, kind=run.kind, checkpoints=ordered, thresholds=thresholds,
                       classes={name: SCORES[name].describe() for name in names},
                       options={"run": run.to_dict(), **options.to_dict()}, min_rise=options.min_rise,
                       heads_ablated=[item.strip() for item in options.heads.split(",") if item.strip()],
                       dtype=dtype.removeprefix("torch."))


def _check(options: TrackOptions) -> None:
    check_positions(options.early, options.late)
    unknown = [name for name in (options.scores or ()) if name not in SCORES]
    if unknown:
        raise ProbeError(f"unknown head class {unknown[0]!r}: choose from {', '.join(SCORES)}", parameter="scores")
    if options.min_rise <= 0:
        raise ProbeError(f"min_rise must be positive, got {options.min_rise}", parameter="min_rise")


@reports("tracking checkpoints")
def track(run: Run, options: TrackOptions | None = None, *, results_path: str | Path, resume: bool = False,
          progress: ProgressArg = None, on_result: OnResult = None, on_model: OnModel = None,
          **load_options: Any) -> TrackResult | None:
    """Score every checkpoint of `run`, each appended to `results_path` (`resume` skips those it holds); under
    torchrun rank 0 returns the merged result, the others None."""
    options = options or TrackOptions()
    _check(options)
    progress = callback(progress)
    rank = current()
    if rank is not None:
        load_options["device"] = rank_device(rank, load_options.get("device"))
    base = load_model(str(run.model), **load_options) if run.kind == STATE_DICTS else None
    check_run(run, base)
    identity = _identity(run, options, load_options)
    results_path = Path(results_path)
    if rank is None:  # resuming what a torchrun job left: its shards too
        known = [entry for path in _visible(results_path) for entry in finished(path, identity)] if resume else []
        stream = _stream(results_path, identity, known)
        try:
            todo = [c for c in run.checkpoints if c.name not in stream.done]
            _score_all(run, todo, options, stream, base, load_options, progress, (on_model, on_result))
        finally:
            stream.close()
        for shard in shard_paths(results_path):
            shard.unlink(missing_ok=True)
        return _result(run, options, stream.done, _model_name(run), identity["dtype"])
    return _sharded(run, options, identity, results_path, resume, base, load_options, progress,
                    (on_model, on_result))


def _model_name(run: Run) -> str:
    """The hub id or factory; for folders, the folder that holds them."""
    return run.model or str(Path(run.checkpoints[0].location).parent)


def _sharded(run: Run, options: TrackOptions, identity: dict[str, Any], results_path: Path, resume: bool,
             base: LoadedModel | None, load_options: dict[str, Any], progress: Progress | None,
             hooks: tuple[OnModel, OnResult]) -> TrackResult | None:
    """This process's share: every world-th checkpoint not finished in any file a process sees."""
    import torch.distributed as dist

    rank = current()
    assert rank is not None
    mine = shard_path(results_path, rank.rank)
    with process_group(load_options.get("device") or (input_device(base.model) if base else None)):
        seen = [entry.to_dict() for path in _visible(results_path) if resume for entry in finished(path, identity)]
        pooled = gather(seen)
        known = {e["name"]: CheckpointResult.from_dict(e) for entries in pooled for e in entries}
        todo = [c for c in run.checkpoints if c.name not in known][rank.rank::rank.world_size]
        stream = _stream(mine, identity, [])
        try:
            _score_all(run, todo, options, stream, base, load_options, progress if rank.is_main else None, hooks)
        finally:
            stream.close()
        for entries in gather([entry.to_dict() for entry in stream.done.values()]):
            known.update({e["name"]: CheckpointResult.from_dict(e) for e in entries})
        final = None
        if rank.is_main:
            _stream(results_path, identity, list(known.values())).close()
            final = _result(run, options, known, _model_name(run), identity["dtype"])
        dist.barrier()
        mine.unlink(missing_ok=True)
    return final


def _visible(results_path: Path) -> list[Path]:
    return [results_path, *shard_paths(results_path)]


def read_track(path: str | Path) -> tuple[dict[str, Any], list[CheckpointResult]]:
    """The header and finished checkpoints of a stream; a last line cut short by an interruption is ignored."""
    path = Path(path)
    (_, header), *rest = json_lines(path, "track", "track results file")
    if not isinstance(header, dict) or header.get("probe_track") != TRACK_FORMAT:
        raise ProbeError(f"{path} is not a probe track results file")
    return header, [CheckpointResult.from_dict(entry) for _, entry in rest]


def finished(path: Path, identity: dict[str, Any]) -> list[CheckpointResult]:
    """The checkpoints a stream holds for this run (same model and options), else one line saying it is another."""
    if not path.is_file() or path.stat().st_size == 0:
        return []
    header, entries = read_track(path)
    as_read = json.loads(json.dumps(identity, default=str))
    if header.get("identity") != as_read:
        changed = sorted(k for k in set(as_read) | set(header.get("identity", {}))
                         if as_read.get(k) != header.get("identity", {}).get(k))
        raise ProbeError(f"cannot resume from {path}: it holds another run ({', '.join(changed) or 'format'} "
                         "differ); start over without resume, or with another results file", parameter="resume")
    return entries


def _stream(path: Path, identity: dict[str, Any], known: list[CheckpointResult]) -> LineStream:
    """The stream of a track run rewritten with `known`, by checkpoint name (`done`)."""
    return LineStream(path, {"probe_track": TRACK_FORMAT, "identity": identity},
                      list({entry.name: entry for entry in known}.values()), key=lambda result: result.name)

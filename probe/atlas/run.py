"""`atlas`: every measurement the atlas shows, run once, stage by stage; a stage the model cannot do is skipped."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

from probe.ablation.results import AblationResult
from probe.ablation.sweep import sweep
from probe.atlas.assemble import Measured, assemble
from probe.atlas.examples import head_examples
from probe.atlas.result import Atlas, Stage
from probe.circuits.composition import UNIT as COMPOSITION_UNIT
from probe.circuits.composition import composition_scores, copying_scores
from probe.inputs import DEFAULT_REPEAT_LEN, DEFAULT_SEED, DEFAULT_SEQ_LEN, ProbeOptions, ProbeSet, build_probe_set
from probe.dla import next_token_attribution
from probe.selfrepair import text_self_repair
from probe.errors import ProbeError
from probe.headvis import head_metrics
from probe.heads.classify import Classification, classify
from probe.heads.evidence import RULES
from probe.models import LoadedModel
from probe.patterns import TOKEN_LIMIT, Patterns, attention_patterns
from probe.progress import StageProgress, StageProgressArg, counter, log, reports, callback, stage_tick

DEFAULT_NUM_SEQS = 4  # sequences per probe set: the exact sweep of SmolLM2's 270 heads, most of the cost, on 4 x 128
# tokens took 353 s on 2 lightly loaded CPU cores (bench/RESULTS.md, section 2); 8 sequences double it
STAGE_UNITS = {"composition": COMPOSITION_UNIT}  # the others are shares: their own units mean nothing to a user


T = TypeVar("T")


@dataclass
class _Stages:
    """Runs stages in order, timing each and reporting its progress under its name."""

    progress: StageProgress | None
    done: list[Stage] = field(default_factory=list)

    def run(self, name: str, work: Callable[[Callable[[int, int], None] | None], T], note: str = "") -> T:
        started = time.perf_counter()
        out = work(stage_tick(self.progress, name))
        self.done.append(Stage(name, time.perf_counter() - started, note))
        log.info("atlas: %s in %.1f s", name, self.done[-1].seconds)
        return out

    def optional(self, name: str, work: Callable[[Callable[[int, int], None] | None], T]) -> T | None:
        """A stage the model may not support: its ProbeError is the stage's note, and the result None."""
        started = time.perf_counter()
        try:
            return self.run(name, work)
        except ProbeError as error:
            self.done.append(Stage(name, time.perf_counter() - started, f"skipped: {error}"))
            log.info("atlas: %s skipped: %s", name, error)
            return None


def _patterns(loaded: LoadedModel, probe_set: ProbeSet) -> Patterns:
    """Every head's pattern on the set's first sequence (classification_patterns' input, for all heads)."""
    patterns = attention_patterns(loaded, probe_set.input_ids[0], source=f"{probe_set.description}; sequence 0",
                                  average=False, thumbnails=False, max_tokens=TOKEN_LIMIT)
    patterns.meta = {"probe_set": probe_set.name, "repeat_len": probe_set.repeat_len, "offset": probe_set.offset}
    return patterns


def _parts(loaded: LoadedModel, classes: Classification, options: ProbeOptions, batch_size: int,
           tick: Callable[[int, int], None] | None) -> dict[str, AblationResult]:
    """The heads of each class whose rule names a probe set part, ablated on that set (exact)."""
    wanted: dict[str, set[tuple[int, int]]] = {}
    for name, rule in RULES.items():
        if rule.probe is not None and name in classes.scores:
            wanted.setdefault(rule.probe, set()).update((layer, h) for layer, h, _ in classes.flagged(name))
    return {probe: sweep(loaded, build_probe_set(probe, loaded, options), sorted(heads), batch_size=batch_size,
                         progress=tick) for probe, heads in wanted.items() if heads}


def _ablate(loaded: LoadedModel, probe_set: ProbeSet, fast: bool, batch_size: int, results: Path | None,
            resume: bool, tick: Callable[[int, int], None] | None) -> AblationResult:
    """Every head: the exact sweep (streamed to `results`, resumable), or the estimate with `fast`."""
    if fast:
        return sweep(loaded, probe_set, mode="estimate", batch_size=batch_size, progress=tick)
    return sweep(loaded, probe_set, batch_size=batch_size, results_path=results, resume=resume and results is not None
                 and results.exists(), progress=tick)


def _results(results_dir: str | Path | None, name: str) -> Path | None:
    if results_dir is None:
        return None
    folder = Path(results_dir)
    if folder.exists() and not folder.is_dir():
        raise ProbeError(f"{folder} is not a folder", parameter="results_dir")
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{name}.jsonl"


@reports("atlas", stages=True)
def atlas(loaded: LoadedModel, *, data: str | Path | None = None, seq_len: int = DEFAULT_SEQ_LEN,
          num_seqs: int = DEFAULT_NUM_SEQS, repeat_len: int = DEFAULT_REPEAT_LEN, seed: int = DEFAULT_SEED,
          thresholds: dict[str, float] | None = None, task: str | Path | None = None, task_count: int = 32,
          fast: bool = False, batch_size: int = 8, results_dir: str | Path | None = None, resume: bool = False,
          progress: StageProgressArg = None, self_repair: bool = False) -> Atlas:
    """Every head's evidence (classes judged by their rules, examples, writes, partners, effects); `fast` estimates
    the natural-text deltas (attribution patching; a task's are exact)."""
    stages = _Stages(callback(progress))
    options = ProbeOptions(data=data, seq_len=seq_len, num_seqs=num_seqs, repeat_len=repeat_len, seed=seed)
    natural_results, task_results = _results(results_dir, "ablation"), _results(results_dir, "task") if task else None
    classes = stages.run("classify", lambda tick: classify(
        loaded, data=data, seq_len=seq_len, num_seqs=num_seqs, repeat_len=repeat_len, seed=seed, thresholds=thresholds,
        batch_size=batch_size, progress=tick))
    natural = build_probe_set("natural", loaded, options)
    composition = stages.optional("composition", lambda tick: composition_scores(loaded.model, loaded.name,
                                                                                  progress=tick))
    copying = stages.optional("copying", lambda tick: copying_scores(loaded.model))
    ablation = stages.run("ablation", lambda tick: _ablate(
        loaded, natural, fast, batch_size, natural_results, resume, tick),
        "estimated (attribution patching)" if fast else "exact")
    parts = stages.run("parts", lambda tick: _parts(loaded, classes, options, batch_size, tick))
    tasks = None if task is None else stages.run("task", lambda tick: _ablate(loaded, build_probe_set(
        "task", loaded, replace(options, task=task, num_seqs=task_count)), False, batch_size, task_results, resume,
        tick), "exact (the estimate does not linearise a task margin)" if fast else "exact")
    examples = stages.optional("examples", lambda tick: head_examples(loaded, natural, batch_size, counter(
        tick, 2 * len(natural.batches(batch_size)))))
    patterns = stages.run("patterns", lambda tick: {  # natural first, each head's pattern shown on its label's set
        name: _patterns(loaded, build_probe_set(name, loaded, options))
        for name in ["natural"] + sorted(set(classes.probe_sets) - {"natural"})})
    dla = stages.optional("dla", lambda tick: next_token_attribution(loaded, natural.input_ids, natural.attention_mask,
                                                                     batch_size=batch_size))
    repair = None if not self_repair else stages.optional("self_repair", lambda tick: text_self_repair(
        loaded, natural, batch_size=batch_size, progress=tick))
    headvis = stages.optional("headvis", lambda tick: head_metrics(loaded, natural, batch_size=batch_size, samples=0,
                                                                   progress=tick))
    measured = Measured(classes, ablation, parts, tasks, composition, copying, examples, dla, fast, repair, headvis)
    settings = {"data": str(data) if data is not None else "natural (probe's English text)", "seq_len": seq_len,
                "num_seqs": num_seqs, "repeat_len": repeat_len, "seed": seed, "fast": fast,
                "task": None if task is None else str(task), "natural": natural.to_dict(), "self_repair": self_repair}
    return assemble(loaded, measured, settings, stages.done, patterns)


"""What a long command says before its work starts: what it will run and how long that takes on this machine, as a
range. The range is counted in forwards of the command's own batch (the unit its work is made of: a sweep runs each
head's ablated forward from that head's layer on) times one such forward timed here, now, so it holds on a laptop, a
loaded machine and a GPU alike (work that is no forward, a layer pair of the weights' composition, is counted in
its own unit, one timed here too); the time left printed once a tenth of the work is done replaces it."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from probe.circuits.composition import pair_seconds
from probe.cli.progress import clock, note, quiet
from probe.heads.classify import classify_work
from probe.hooks.layers import attention_layers
from probe.hooks.run import run_model
from probe.inputs import ProbeOptions
from probe.models import LoadedModel

SWEEP_FORWARDS = (0.5, 1.0)  # one head's exact ablation, in forwards of the batch (bench/RESULTS.md: 0.60-0.73x)
CAPTURE = (1.0, 2.0)  # a pass that reads every head's attention (classify's, syntax's), in forwards of its batch
PAIR = (1.0, 5.0)  # a layer pair of the weights' composition, in the pair timed with its share of the set-up (1.5-5x)
COUNTED = (0.5, 1.2)  # a sweep counted in forwards by its own cost model (sweep_forwards); bench/NOTES.md: 0.49-1.62x
SLACK = (0.8, 1.6)  # the timed forward against a forward inside the work (warm caches, a busy machine)
SAID_FROM = 30.0  # seconds: work whose range reaches this is said; shorter work says nothing


@dataclass(frozen=True)
class Unit:
    """A unit of work that is not a forward of a batch: its name as the plan says it (`layer pair`), and how to time
    one here (seconds)."""

    name: str
    seconds: Callable[[], float]


@dataclass(frozen=True)
class Work:
    """Work of one kind: `forwards` (low, high) of `batch` (or that many of a `Unit`), said as `what`. `later`: work
    that an earlier part sizes (circuits' check, sized by the induction heads the classification finds), said in a
    line of its own once that part is done: this line names it and leaves it out of its range, and its high end
    only decides whether the line is said."""

    what: str
    batch: Tensor | Unit
    forwards: tuple[float, float]
    later: bool = False


@dataclass(frozen=True)
class Estimate:
    """A plan's range in seconds, its parts as said, how its units were timed, and `reach`: the high end with the
    bounds of the work planned later."""

    low: float
    high: float
    parts: list[str]
    timings: str
    reach: float

    def line(self) -> str:
        """`plan: PARTS: about LOW-HIGH here (TIMINGS)`: the line bench/tour.py parses."""
        return f"plan: {'; then '.join(self.parts)}: about {span(self.low, self.high)} here ({self.timings})"


def forward_seconds(loaded: LoadedModel, batch: Tensor, batch_size: int, runs: int = 2) -> float:
    """Seconds of one forward of `batch` (in rows of `batch_size`, as the work runs it) on this machine: the last of
    `runs` (the first of a process pays one-off costs; a plan's later shapes run once)."""
    seconds = 0.0
    with torch.no_grad():
        for _ in range(runs):
            started = time.perf_counter()
            for chunk in batch.split(max(batch_size, 1)):
                run_model(loaded.model, chunk, logits=False)
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            seconds = time.perf_counter() - started
    return seconds


def span(low: float, high: float) -> str:
    """`40 s-1:30`, or `2:10-4:40`: a range as a person reads it."""
    def one(seconds: float) -> str:
        return f"{seconds:.0f} s" if seconds < 60 else clock(seconds)
    return f"{one(low)}-{one(high)}" if one(low) != one(high) else one(low)


def plan(loaded: LoadedModel, works: Sequence[Work], batch_size: int, show: bool = True) -> tuple[float, float] | None:
    """Say the parts of the work and the range of the whole in one line, where the range reaches SAID_FROM seconds
    (`-q`, or `show` False: nothing, and nothing timed); the range in seconds, None where nothing was timed."""
    estimate = estimated(loaded, works, batch_size) if show else None
    if estimate is None:
        return None
    say(estimate)
    return estimate.low, estimate.high


def estimated(loaded: LoadedModel, works: Sequence[Work], batch_size: int, warm: bool = False) -> Estimate | None:
    """The range of `works`, each unit timed here once (the first forward twice, its first run paying a process's
    one-off costs, unless `warm`: the process has run the model already); None under `-q` (nothing timed) or where
    nothing could be timed."""
    if not works or quiet():
        return None
    low = high = reach = 0.0
    parts = []
    timed: dict[object, float] = {}
    for work in works:
        key = work.batch.name if isinstance(work.batch, Unit) else tuple(work.batch.shape)
        if key not in timed:
            try:
                timed[key] = work.batch.seconds() if isinstance(work.batch, Unit) else \
                    forward_seconds(loaded, work.batch, batch_size, runs=1 if warm or _forwards(timed) else 2)
            except Exception:  # a plan is advice: input the work refuses (a length past the model's) is refused by
                continue  # the work itself, in its own one line, or skipped (the ICL score past the model's context)
        if key not in timed:
            continue
        reach += work.forwards[1] * timed[key] * SLACK[1]
        if not work.later:
            low += work.forwards[0] * timed[key] * SLACK[0]
            high += work.forwards[1] * timed[key] * SLACK[1]
        parts += [f"{work.what}, planned once known and not in this range" if work.later else work.what] \
            if work.what else []
    return Estimate(low, high, parts, _timings(timed), reach) if timed else None


def say(estimate: Estimate, said_from: float | None = None) -> bool:
    """Say `estimate`'s line where its reach (its range's high end and the later work's bounds) reaches `said_from`
    seconds (SAID_FROM); whether it was said."""
    if estimate.reach < (SAID_FROM if said_from is None else said_from):
        return False
    note(estimate.line())
    return True


def _forwards(timed: dict[object, float]) -> list[float]:
    return [seconds for key, seconds in timed.items() if not isinstance(key, str)]


def _timings(timed: dict[object, float]) -> str:
    """`one forward of the batch timed: 0.52 s, 0.21 s; one layer pair timed: 0.03 s`."""
    forwards = _forwards(timed)
    said = [f"one forward of the batch timed: {', '.join(f'{seconds:.2f} s' for seconds in forwards)}"] \
        if forwards else []
    return "; ".join(said + [f"one {key} timed: {seconds:.2f} s" for key, seconds in timed.items()
                             if isinstance(key, str)])


def sweep_work(what: str, heads: int, batch: Tensor, unit: str = "heads") -> Work:
    """An exact sweep of `heads` heads (or other `unit`s, each one run: a key/value group patched) over `batch`
    (each one's forward from its layer on)."""
    return Work(f"{what} ({heads} {unit}, one forward each from its layer on, on {_tokens(batch)})", batch,
                (SWEEP_FORWARDS[0] * heads, SWEEP_FORWARDS[1] * heads))


def counted_sweep_work(what: str, heads: str, ablations: int, forwards: float, batch: Tensor) -> Work:
    """A sweep of `ablations` of `heads` (as said) whose work the library counted as `forwards` of `batch`
    (`probe.ablation.sweep.sweep_forwards`: the baseline and each ablation from its block on), and up to one forward
    more: the prefix reuse's self-check."""
    return Work(f"{what} ({heads}: {ablations} ablations, one forward each from its layer on, on {_tokens(batch)})",
                batch, (COUNTED[0] * forwards, COUNTED[1] * (forwards + 1.0)))


def classify_works(loaded: LoadedModel, options: ProbeOptions, scores: list[str] | None = None) -> list[Work]:
    """`classify`'s passes, each a forward of its probe set that reads every head's attention (CAPTURE)."""
    work = classify_work(loaded, options, scores)
    passes = sum(count for _, count in work.values())
    said = f"classifying every head ({passes} pass(es) over {len(work)} probe set(s))"
    return [Work(said if index == 0 else "", probe_set.input_ids, (CAPTURE[0] * count, CAPTURE[1] * count))
            for index, (probe_set, count) in enumerate(work.values())]


def composition_work(loaded: LoadedModel, kinds: str) -> Work:
    """The weights' composition of every head into every later head, for each of `kinds` (K, Q, V): layer pairs,
    one timed here (`pair_seconds`)."""
    layers = len(attention_layers(loaded.model))
    pairs = len(kinds) * layers * (layers - 1) // 2
    return Work(f"{'/'.join(kind.upper() for kind in kinds)}-composition ({pairs} layer pairs, from the weights)",
                Unit("layer pair", lambda: pair_seconds(loaded.model)), (PAIR[0] * pairs, PAIR[1] * pairs))


def _tokens(batch: Tensor) -> str:
    rows, length = batch.shape[0], batch.shape[-1]
    return f"{rows} x {length} tokens"


def planned_first(say_plan: Callable[[], object], update: Callable[..., None]) -> Callable[..., None]:
    """`update` (a `(done, total)` or `(stage, done, total)` callback), with the plan said at its first report:
    after the library has checked its arguments and inputs (a refusal stays the only line), before the work. Only
    for a library call whose first report comes before any hook is on the model (kv_heads', atlas' and circuits':
    their first stage's 0; syntax_scores': its 0 before the first batch): the plan runs forwards of its own."""
    planned: list[bool] = []

    def first_the_plan(*report: object) -> None:
        if not planned:
            planned.append(True)
            say_plan()
        update(*report)
    return first_the_plan

"""What a long command says before its work: one `plan:` line with its parts and a range of how long, counted in
units timed here (forwards of its batch, the weights' layer pairs, a checkpoint's load), said before the work
starts; and the library's own `progress=True` bar, drawn again at least every 30 s while a call reports nothing."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import re
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import probe.circuits.pairs as pairs
import probe.cli.plans as plans
import probe.cli.progress as cli_progress
import probe.progress as library_progress
from conftest import run_cli
from planted import planted_textbook
from planted_syntax import conllu_corpus
from probe.models import LoadedModel
from test_progress import COMMANDS, on_a_fake_clock
from test_track import tiny_checkpoints

TESTS = Path(__file__).parent
PLAN = re.compile(r"^plan: .*: about (?P<low>[\d:]+)(?: s)?(?:-(?P<high>[\d:]+)(?: s)?)? here")  # its range


def _clock_seconds(text: str) -> float:
    """`1:36` or `24`: seconds."""
    seconds = 0.0
    for part in text.split(":"):
        seconds = 60 * seconds + int(part)
    return seconds


@pytest.fixture(autouse=True)
def _loud() -> Iterator[None]:
    cli_progress.set_quiet(False)
    yield
    cli_progress.set_quiet(False)


# ---------------------------------------------------------------------------------------------------------------
# the plan line: units that are no forward, work that cannot be timed


def test_a_unit_that_is_no_forward_is_timed_once_and_said_in_the_line(capsys) -> None:
    timings: list[int] = []

    def pair() -> float:
        timings.append(1)
        return 0.5

    unit = plans.Unit("layer pair", pair)
    works = [plans.Work("K-composition (100 layer pairs)", unit, (50, 100)),
             plans.Work("", unit, (10, 20))]  # a second part in the same unit: not timed again, not named
    assert plans.plan(None, works, 8) == pytest.approx((60 * 0.5 * 0.8, 120 * 0.5 * 1.6))  # type: ignore[arg-type]
    line = capsys.readouterr().err.strip()
    assert line == "plan: K-composition (100 layer pairs): about 24 s-1:36 here (one layer pair timed: 0.50 s)"
    assert timings == [1]
    found = PLAN.match(line)
    assert found is not None and (found["low"], found["high"]) == ("24", "1:36")


def test_work_that_cannot_be_timed_is_left_out_and_the_rest_said(capsys, monkeypatch) -> None:
    """The in-context learning score past a small model's context: the library skips it, the plan leaves it out."""
    runs_of: list[int] = []

    def forward(loaded, batch, batch_size, runs=2) -> float:
        runs_of.append(runs)
        if batch.shape[1] > 64:
            raise IndexError("index out of range in self")
        return 1.0

    monkeypatch.setattr(plans, "forward_seconds", forward)
    short, long = torch.ones((2, 32), dtype=torch.long), torch.ones((2, 501), dtype=torch.long)
    said = plans.plan(None, [plans.Work("the loss", short, (40, 40)),  # type: ignore[arg-type]
                             plans.Work("the score past the context", long, (40, 40))], 8)
    assert said == pytest.approx((32.0, 64.0))
    assert runs_of == [2, 1]  # the first shape run twice (one-off costs), a later one once
    assert capsys.readouterr().err == "plan: the loss: about 32 s-1:04 here (one forward of the batch timed: " \
                                      "1.00 s)\n"


def test_work_planned_later_is_named_left_out_of_the_range_and_decides_only_whether_the_line_is_said(
        capsys, monkeypatch) -> None:
    runs_of: list[int] = []

    def forward(loaded, batch, batch_size, runs=2) -> float:
        runs_of.append(runs)
        return 1.0

    monkeypatch.setattr(plans, "forward_seconds", forward)
    batch = torch.ones((2, 32), dtype=torch.long)
    works = [plans.Work("classifying", batch, (5, 10)),
             plans.Work("the check (up to 40 ablations)", batch, (0, 40), later=True)]
    estimate = plans.estimated(None, works, 8)  # type: ignore[arg-type]
    assert estimate is not None
    assert (estimate.low, estimate.high, estimate.reach) == pytest.approx((4.0, 16.0, 80.0))
    assert plans.say(estimate)  # the whole may reach SAID_FROM: said, its range that of the work before the check
    line = capsys.readouterr().err.strip()
    assert line == "plan: classifying; then the check (up to 40 ablations), planned once known and not in this " \
                   "range: about 4 s-16 s here (one forward of the batch timed: 1.00 s)"
    found = PLAN.match(line)
    assert found is not None and (found["low"], found["high"]) == ("4", "16")
    later = plans.estimated(None, [plans.Work("the check (3 ablations)", batch, (2, 5))], 8, warm=True)  # type: ignore[arg-type]
    assert later is not None and (later.low, later.high) == pytest.approx((1.6, 8.0))
    assert runs_of == [2, 1]  # a warm process times its first forward once
    assert not plans.say(later) and capsys.readouterr().err == ""  # on its own: under SAID_FROM
    assert plans.say(later, 0.0)  # after a line that left the check to it: said whatever its length
    assert capsys.readouterr().err.startswith("plan: the check (3 ablations): about 2 s-8 s here")


# ---------------------------------------------------------------------------------------------------------------
# each long command: one plan line, in the format the tour parses, before its work starts

def _syntax(tmp_path: Path) -> list[str]:
    corpus = tmp_path / "parses.conllu"
    corpus.write_text(conllu_corpus(12), encoding="utf-8")
    return ["syntax", "--model", "tests/planted_syntax.py:planted_pair", "--conllu", str(corpus), "--min-count", "1"]


def _track(tmp_path: Path) -> list[str]:
    tiny_checkpoints(tmp_path / "ckpt", (1, 2))
    return ["track", "--model", f"{TESTS / 'track_models.py'}:tiny", "--checkpoints", str(tmp_path / "ckpt" / "*.pt"),
            "--seq-len", "24", "--num-seqs", "2", "--repeat-len", "8", "--icl-seqs", "2"]


ARGS = {"atlas": lambda _: COMMANDS["atlas"], "circuits": lambda _: COMMANDS["circuits"],
        "steer": lambda _: COMMANDS["steer"], "syntax": _syntax, "track": _track}
WORK = {  # the library call where each command's work starts: a spy there marks the start in stderr
    "atlas": "probe.atlas.run.classify", "circuits": "probe.circuits.pairs.composition_scores",
    "steer": "probe.steering.baseline_metric", "syntax": "probe.syntax.run.capture_attention",
    "track": "probe.track.run.measure"}
PARTS = {  # what each plan names
    "atlas": ["classifying every head", "K/Q/V-composition", "ablating every head",
              "copying scores, examples, patterns and DLA"],
    "circuits": ["K-composition (1 layer pairs, from the weights)", "classifying every head",
                 "then the ablation check (each induction head found and its feeder, alone and together: up to 12 "
                 "ablations), planned once known and not in this range: about "],
    "steer": ["measuring 2 head(s) at 2 value(s)", "generating 3 tokens in 5 rows"],
    "syntax": ["reading every head's attention on 12 sentences (2 batch(es))"],
    "track": ["2 checkpoint(s), each loaded (the first in", "classifying every head", "the loss"],
}


def _marking(target: str, monkeypatch) -> None:
    module, _, name = target.rpartition(".")
    original = getattr(importlib.import_module(module), name)

    def marked(*args, **kwargs):
        sys.stderr.write("WORK STARTS\n")
        return original(*args, **kwargs)

    monkeypatch.setattr(target, marked)


@pytest.mark.parametrize("command", list(ARGS))
def test_a_long_command_says_its_plan_in_the_tours_format_before_its_work(command: str, tmp_path: Path, capsys,
                                                                         monkeypatch) -> None:
    monkeypatch.setattr(plans, "SAID_FROM", 0.0)  # the tiny models' work takes a moment: say it anyway
    monkeypatch.setattr("probe.inputs.contrast.MIN_GAP", 1e-4)  # a random tiny model's corruption changes little
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path))
    monkeypatch.chdir(TESTS.parent)
    _marking(WORK[command], monkeypatch)
    code, _, stderr = run_cli([*ARGS[command](tmp_path), "--json", str(tmp_path / "out.json")], capsys, monkeypatch)
    assert code == 0, stderr
    lines = stderr.splitlines()
    said = [index for index, line in enumerate(lines) if PLAN.match(line)]
    # circuits plans its check in a second line, once the classification has found the induction heads
    assert len(said) == (2 if command == "circuits" else 1) and said[0] < lines.index("WORK STARTS"), stderr
    assert all(part in lines[said[0]] for part in PARTS[command]), lines[said[0]]
    for line in (lines[index] for index in said):
        assert re.search(r"\((?:one forward of the batch timed: [\d.]+ s(?:, [\d.]+ s)*)?(?:; )?"
                         r"(?:one [a-z ]+ timed: [\d.]+ s(?:; )?)*\)$", line), line


FORWARD = 10.0  # seconds: the fake timing of every forward a plan times


def test_circuits_plans_its_check_once_the_classification_has_sized_it(tmp_path: Path, capsys,
                                                                        monkeypatch) -> None:
    """On a fake clock, with every timed forward FORWARD s: the first line leaves the check out of its range, the
    second names the heads the check ablates and holds the time the check's sweep counts (its work in forwards of its
    batch, each FORWARD s, and the prefix reuse's self-check)."""
    monkeypatch.setattr(plans, "forward_seconds", lambda loaded, batch, batch_size, runs=2: FORWARD)
    monkeypatch.setattr(plans, "pair_seconds", lambda model: 0.5)
    counted: list[tuple[int, int]] = []  # the check's sweep: its (done, total) in thousandths of a batch's forward
    original = pairs.sweep

    def sweep(*args, progress=None, **kwargs):
        def spy(done: int, total: int) -> None:
            counted.append((done, total))
            if progress is not None:
                progress(done, total)
        return original(*args, progress=spy, **kwargs)

    monkeypatch.setattr(pairs, "sweep", sweep)
    page = tmp_path / "circuits.html"  # --html: the same command, its page written after the work
    lines = on_a_fake_clock("circuits", [*ARGS["circuits"](tmp_path), "--html", str(page)], tmp_path, capsys,
                            monkeypatch)
    said = [index for index, line in enumerate(lines) if PLAN.match(line)]
    assert len(said) == 2 and page.is_file(), lines
    assert said[0] < lines.index("circuits: K-composition ...") and "not in this range" in lines[said[0]]
    # once the classification is in (its last line, at its total, before the plan times a forward), before the check
    assert lines.index("circuits: classifying heads ...") < said[1] < lines.index("circuits: ablation check ...")
    ended = [index for index, line in enumerate(lines) if line.startswith("circuits: classifying heads: 100%")]
    assert ended and ended[0] < said[1], lines
    payload = json.loads((tmp_path / "out.json").read_text())
    checked = [entry for entry in payload["induction_heads"] if entry["checked"] is not None]
    heads = {(entry["layer"], entry["head"]) for entry in checked} | \
        {(entry["checked"]["layer"], entry["checked"]["head"]) for entry in checked}
    assert checked and f"plan: the ablation check ({len(heads)} heads, {len(checked)} of them induction heads, alone " \
                       f"and in pairs: {len(heads) + len(checked)} ablations, one forward each from its layer on, " \
                       in lines[said[1]]
    done, total = counted[-1]  # --num-seqs 2, --batch-size 8: one batch, the whole set
    assert done == total
    outcome = FORWARD * (total / 1000 + 1)  # the sweep's forwards of its one batch, and the self-check's one
    found = PLAN.match(lines[said[1]])
    assert found is not None
    assert _clock_seconds(found["low"]) <= FORWARD * total / 1000 and outcome <= _clock_seconds(found["high"]), \
        (lines[said[1]], outcome)


@pytest.mark.parametrize(("command", "stage"), [("syntax", "scoring sentences"), ("track", "tracking")])
def test_syntax_and_track_on_a_fake_clock_name_their_stage_first_and_count_it_to_the_end(
        command: str, stage: str, tmp_path: Path, capsys, monkeypatch) -> None:
    lines = on_a_fake_clock(command, ARGS[command](tmp_path), tmp_path, capsys, monkeypatch)
    counted = [index for index, line in enumerate(lines) if line.startswith(f"{stage}: ")]
    assert counted and lines.index(f"{stage} ...") < counted[0], lines  # named before its first count
    assert re.match(rf"{stage}: (\d+)/\1 [a-z]+ \(100%\)", lines[counted[-1]]), lines


def test_a_plan_is_not_said_with_quiet_and_nothing_is_timed(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(plans, "SAID_FROM", 0.0)
    monkeypatch.setattr(plans, "forward_seconds", lambda *_: pytest.fail("timed under -q"))
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path))
    monkeypatch.chdir(TESTS.parent)
    code, _, stderr = run_cli([*COMMANDS["circuits"], "-q"], capsys, monkeypatch)
    assert code == 0 and stderr == "", stderr


def test_compositions_layer_pair_is_timed_on_the_models_own_weights() -> None:
    from probe.circuits.composition import pair_seconds

    assert pair_seconds(planted_textbook()) > 0.0


# ---------------------------------------------------------------------------------------------------------------
# the library's `progress=True`: its bar drawn again at least every 30 s, by a thread that lives as long as the call


def _bar_on(clock: list[float], stages: bool = False):
    now = lambda: clock[0]  # noqa: E731
    return library_progress.StageBars("atlas", now) if stages else library_progress.TextBar("ablating heads", now)


def test_a_bar_silent_for_30_seconds_is_drawn_again_with_its_time(capsys) -> None:
    clock = [0.0]
    bar = _bar_on(clock)
    for clock[0] in (10.0, 28.0):
        bar.tick()
    assert capsys.readouterr().err == ""  # nothing reported, under 30 s: nothing drawn
    clock[0] = 31.0
    bar.tick()
    assert capsys.readouterr().err == "\rablating heads ... 0:31"  # before any report: that it runs, and how long
    clock[0] = 40.0
    bar(3, 12)
    clock[0] = 55.0
    bar.tick()
    clock[0] = 71.0
    bar.tick()
    assert capsys.readouterr().err.split("\r")[1:] == [
        "ablating heads [#######.......................] 3/12 0:40",
        "ablating heads [#######.......................] 3/12 1:11"]  # 31 s after the last drawing
    bar(12, 12)
    clock[0] = 200.0
    bar.tick()
    assert capsys.readouterr().err.endswith("12/12 1:11\n")  # the end: a newline, and no drawing after it


def test_stage_bars_tick_the_stage_that_runs(capsys) -> None:
    clock = [0.0]
    bars = _bar_on(clock, stages=True)
    bars("classify", 0, 1)
    bars("classify", 1, 1)
    bars("patterns", 0, 1)  # a stage that counts nothing until its end
    clock[0] = 45.0
    bars.tick()
    assert capsys.readouterr().err.split("\r")[-1] == "atlas: patterns [..............................] 0/1 0:45"


def test_progress_true_runs_a_heartbeat_for_the_call_and_not_after(capsys, monkeypatch) -> None:
    ticked = threading.Event()
    original = library_progress.TextBar.tick

    def tick(self) -> None:
        original(self)
        ticked.set()

    monkeypatch.setattr(library_progress.TextBar, "tick", tick)
    monkeypatch.setattr(library_progress, "BEAT", 0.01)
    seen: list[object] = []

    @library_progress.reports("working")
    def work(*, progress=None) -> None:
        seen.append(progress)
        assert ticked.wait(60)  # a tick came while the call ran (nothing timed: it waits for it)

    work(progress=True)
    assert isinstance(seen[0], library_progress.TextBar)
    assert not [thread for thread in threading.enumerate() if thread.name == "probe-progress"]

    @library_progress.reports("failing")
    def failing(*, progress=None) -> None:
        raise RuntimeError("inside the call")

    with pytest.raises(RuntimeError):
        failing(progress=True)
    assert not [thread for thread in threading.enumerate() if thread.name == "probe-progress"]  # ended on the error
    calls: list[object] = []
    work_with = library_progress.reports("x")(lambda *, progress=None: calls.append(progress))
    work_with(progress=print)
    assert calls == [print]  # a callable is the caller's own: no bar, no thread


def test_classify_progress_true_draws_its_bar_to_the_end(capsys) -> None:
    from probe import classify

    loaded = LoadedModel(model=planted_textbook(), tokenizer=None, name="planted", vocab_size=200)
    with contextlib.redirect_stderr(io.StringIO()) as stderr:
        classify(loaded, seq_len=16, num_seqs=2, repeat_len=8, progress=True)
    drawn = stderr.getvalue()
    assert drawn.startswith("\rclassifying heads [") and drawn.endswith("\n")
    assert re.search(r"\] (\d+)/\1 \d+:\d\d\n$", drawn), drawn

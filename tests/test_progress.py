"""Progress that says what each stage of a command is doing, in units a user knows, to its total: the circuits'
stages, the atlas' composition stage (~90 s on SmolLM2), and the model load and every other uncounted step off a
terminal; off a terminal a line at least every 30 s (on a fake clock), a time left only past a tenth of the stage and
never below what its rate since its start says."""

from __future__ import annotations

import io
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

import probe.cli.options as options
import probe.cli.progress as cli_progress
import probe.progress as library_progress
from conftest import run_cli
from planted import planted_lm, planted_textbook
from probe.atlas import atlas
from probe.atlas.run import STAGE_UNITS as ATLAS_UNITS
from probe.circuits.composition import UNIT, composition_scores
from probe.circuits.pairs import STAGE_UNITS as CIRCUITS_UNITS
from probe.circuits.pairs import circuits
from probe.models import LoadedModel

TESTS = Path(__file__).parent
PLANTED = f"{TESTS / 'planted.py'}:planted_textbook"
SMALL = {"seq_len": 16, "num_seqs": 2, "repeat_len": 8}


def _stages(reports: list[tuple[str, int, int]]) -> dict[str, list[tuple[int, int]]]:
    """Each stage's reports in order, the stages in the order they started."""
    by_stage: dict[str, list[tuple[int, int]]] = {}
    for stage, done, total in reports:
        by_stage.setdefault(stage, []).append((done, total))
    return by_stage


def _ends_at_its_total(reports: list[tuple[int, int]]) -> bool:
    dones = [done for done, _ in reports]
    return dones == sorted(dones) and reports[-1][0] == reports[-1][1] > 0


@pytest.fixture(autouse=True)
def _loud() -> Iterator[None]:
    cli_progress.set_quiet(False)
    yield
    cli_progress.set_quiet(False)


# ---------------------------------------------------------------------------------------------------------------
# composition: counted in layer pairs, to the total


def test_composition_counts_layer_pairs_to_the_total() -> None:
    reports: list[tuple[int, int]] = []
    import transformers as tf

    model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=120, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=5, num_attention_heads=4)).eval()
    composition_scores(model, progress=lambda done, total: reports.append((done, total)))
    assert reports[0] == (0, 3 * 10)  # K, Q and V; 10 (earlier, later) pairs of 5 layers each
    assert [done for done, _ in reports] == [0, 1, 3, 6, 10, 11, 13, 16, 20, 21, 23, 26, 30]  # after each later layer
    assert {total for _, total in reports} == {30}


# ---------------------------------------------------------------------------------------------------------------
# circuits: every stage named and counted, the ablation check too


def test_circuits_reports_each_stage_to_its_total() -> None:
    reports: list[tuple[str, int, int]] = []
    loaded = LoadedModel(model=planted_textbook(), tokenizer=None, name="planted", vocab_size=200)
    circuits(loaded, **SMALL, batch_size=2, progress=lambda *report: reports.append(report))
    stages = _stages(reports)
    assert list(stages) == ["K-composition", "classifying heads", "ablation check"]
    assert all(_ends_at_its_total(counts) for counts in stages.values()), stages
    assert stages["K-composition"][-1] == (1, 1) and CIRCUITS_UNITS == {"K-composition": UNIT}  # 2 layers: 1 pair


def test_circuits_command_names_each_stage_off_a_terminal(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path))
    slow_clock(monkeypatch)
    code, _, stderr = run_cli(["circuits", "--model", PLANTED, "--num-seqs", "2", "--repeat-len", "8", "--seq-len",
                               "16"], capsys, monkeypatch)
    assert code == 0, stderr
    said = [stage for stage in ("K-composition", "classifying heads", "ablation check")
            if any(line.startswith(f"circuits: {stage} ") for line in stderr.splitlines())]
    assert said == ["K-composition", "classifying heads", "ablation check"], stderr


def slow_clock(monkeypatch, step: float = 4.0) -> None:
    """Every look at the bars' clock `step` seconds later, and no heartbeat thread looking at it."""
    clock = [0.0]

    def later() -> float:
        clock[0] += step
        return clock[0]

    monkeypatch.setattr(library_progress, "monotonic", later)
    monkeypatch.setattr(library_progress, "BEAT", 1e6)


# ---------------------------------------------------------------------------------------------------------------
# atlas: the composition stage counted in layer pairs; every stage named off a terminal


def test_atlas_composition_stage_counts_layer_pairs() -> None:
    reports: list[tuple[str, int, int]] = []
    loaded = LoadedModel(model=planted_lm(), tokenizer=None, name="planted", vocab_size=200)
    atlas(loaded, **SMALL, batch_size=2, progress=lambda *report: reports.append(report))
    stages = _stages(reports)
    assert stages["composition"][-1] == (3, 3) and ATLAS_UNITS["composition"] == UNIT  # 3 kinds x 1 layer pair
    assert list(stages)[:3] == ["classify", "composition", "copying"] and "dla" in stages


def test_stages_off_a_terminal_count_in_their_unit_and_end_at_their_total(capsys, monkeypatch) -> None:
    clock = [0.0]
    monkeypatch.setattr(library_progress, "monotonic", lambda: clock[0])
    monkeypatch.setattr(library_progress, "BEAT", 1e6)
    with cli_progress.progress_bar("atlas", {"composition": "layer pairs"}) as bars:
        assert bars is not None
        update = bars.stage
        update("composition", 0, 1)
        for done in range(0, 31, 3):
            clock[0] += 2.0
            update("composition", done, 30)
        update("patterns", 0, 1)  # a stage that counts nothing until its end
        clock[0] += 5.0
        update("patterns", 1, 1)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "atlas: composition 3/30 layer pairs, 0.75/s, 0:04 elapsed, ~0:36 left"  # its first tenth
    assert lines[-2] == "atlas: composition 30/30 layer pairs, 1.4/s, 0:22 elapsed"
    assert lines[-1] == "atlas: patterns 100%, 20%/s, 0:05 elapsed"


# ---------------------------------------------------------------------------------------------------------------
# the model load, and every other step without a count: said on a terminal and off it, with its seconds


def _slow_load(seconds: float):
    def load_model(spec: str, **_kwargs) -> LoadedModel:
        time.sleep(seconds)
        return LoadedModel(model=planted_textbook(), tokenizer=None, name=spec, vocab_size=200)
    return load_model


def test_a_slow_load_off_a_terminal_says_so_and_how_long_it_took(capsys, monkeypatch) -> None:
    monkeypatch.setattr(cli_progress, "ANNOUNCE_AFTER", 0.2)
    monkeypatch.setattr(library_progress, "BEAT", 0.05)
    monkeypatch.setattr(options, "load_model", _slow_load(0.6))
    options.load("planted")
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "loading planted ... 0:00 elapsed" and len(lines) == 2, lines
    assert re.fullmatch(r"loaded planted in 0\.[6-9] s|loaded planted in [1-9]\.\d s", lines[1]), lines


def test_a_load_in_a_moment_or_with_quiet_says_nothing(capsys, monkeypatch) -> None:
    monkeypatch.setattr(cli_progress, "ANNOUNCE_AFTER", 1.5)  # building the planted model: well under it, even on a
    monkeypatch.setattr(options, "load_model", _slow_load(0.0))  # busy machine
    options.load("planted")
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(cli_progress, "ANNOUNCE_AFTER", 0.2)
    monkeypatch.setattr(options, "load_model", _slow_load(0.5))
    cli_progress.set_quiet(True)
    options.load("planted")
    assert capsys.readouterr().err == ""


def test_a_slow_load_on_a_terminal_says_how_long_it_took(monkeypatch) -> None:
    screen = io.StringIO()
    monkeypatch.setattr(cli_progress, "errors", Console(file=screen, force_terminal=True, width=100))
    monkeypatch.setattr(cli_progress, "ANNOUNCE_AFTER", 0.2)
    monkeypatch.setattr(options, "load_model", _slow_load(0.4))
    options.load("planted")
    assert "loading planted ..." in screen.getvalue() and re.search(r"loaded planted in \d\.\d s", screen.getvalue())


def test_a_step_without_a_count_off_a_terminal_is_said_and_timed(capsys, monkeypatch) -> None:
    monkeypatch.setattr(cli_progress, "ANNOUNCE_AFTER", 0.2)
    monkeypatch.setattr(library_progress, "BEAT", 0.05)
    with cli_progress.status("capturing attention ..."):
        time.sleep(0.5)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "capturing attention ... 0:00 elapsed"
    assert re.fullmatch(r"capturing attention: done in \d\.\d s", lines[1])
    with pytest.raises(RuntimeError), cli_progress.status("capturing attention ..."):
        raise RuntimeError("at once")
    assert capsys.readouterr().err == ""  # an error in a moment stays the only line: the error's own


# ---------------------------------------------------------------------------------------------------------------
# off a terminal: a line at least every 30 s (the heartbeat's tick), a time left only past a tenth, from the rate
# since the stage's start


def bars_on(clock: list[float], label: str = "kv-heads", units: dict[str, str] | None = None,
            first: float = library_progress.EVERY_SECONDS) -> tuple[library_progress.Bars, io.StringIO]:
    """Bars off a terminal on `clock`, and what they write."""
    written = io.StringIO()
    bars = library_progress.Bars(label, units, first=first, console=Console(file=written, width=4096),
                                 now=lambda: clock[0])
    bars.stop.set()  # no heartbeat thread: the test ticks itself
    return bars, written


def test_a_stage_silent_for_30_seconds_still_gets_a_line_every_30_seconds(capsys) -> None:
    clock = [0.0]
    bars, written = bars_on(clock, units={"calibrating the budget": "points"})
    with bars:
        clock[0] = 20.0
        bars.tick()  # before any report, under 30 s: nothing
        clock[0] = 30.0
        bars.tick()  # 30 s with nothing reported: that it runs
        bars.stage("calibrating the budget", 1, 8)  # the unablated point
        for seconds in (40.0, 55.0):
            clock[0] = seconds
            bars.tick()  # under 30 s of the stage's silence: nothing
        for seconds in (60.0, 75.0, 90.0):
            clock[0] = seconds
            bars.tick()
        clock[0] = 100.0
        bars.stage("calibrating the budget", 2, 8)  # past a tenth, and a rate: 70 s a point since the first
    assert written.getvalue().splitlines() == [
        "kv-heads 0:30 elapsed",
        "kv-heads: calibrating the budget 1/8 points, 0:30 elapsed",  # no rate measured yet: no time left
        "kv-heads: calibrating the budget 1/8 points, 1:00 elapsed",
        "kv-heads: calibrating the budget 2/8 points, 0.014/s, 1:10 elapsed, ~7:00 left",
        "kv-heads: calibrating the budget 8/8 points, 0.1/s, 1:10 elapsed"]  # its end: at its total


def test_a_new_stage_says_its_first_line_before_30_seconds() -> None:
    """The heartbeat looks once a second: a stage's first line is due a beat early, so no silence passes 30 s."""
    clock = [0.0]
    bars, written = bars_on(clock, units={"calibrating the budget": "points"})
    with bars:
        bars.stage("calibrating the budget", 0, 8)
        clock[0] = 28.0
        bars.tick()
        assert written.getvalue() == ""
        clock[0] = 28.5
        bars.tick()
    assert written.getvalue().splitlines()[0] == "kv-heads: calibrating the budget 0/8 points, 0:28 elapsed"

def test_no_time_left_before_a_tenth_of_the_stage() -> None:
    """Patching said `~3:06:39 left` at 0%: a rate from the first units is not one to trust."""
    clock = [0.0]
    bars, written = bars_on(clock, "patching heads")
    with bars:
        for done in range(1, 100):
            clock[0] += 31.0
            bars(done, 1000)
            bars.tick()  # a line every 31 s, each under a tenth
        lines = written.getvalue().splitlines()
        assert len(lines) == 99 and not any("left" in line for line in lines)
        clock[0] += 31.0
        bars(100, 1000)  # a tenth: a line, with the time left
        assert written.getvalue().splitlines()[-1] == "patching heads 10%, 0.19%/min, 51:40 elapsed, ~7:45:00 left"


def test_the_time_left_is_the_measured_rate_since_the_first_count_never_below_the_time_spent() -> None:
    """A minute of set-up, then a head every 2 s: the time left is the truth at every line (the rate since the
    bar's start would have said ~15 minutes at the first), and the stage's whole (its time spent and left) never
    reads below the time already spent; the last line is at the total, with no time left."""
    clock = [0.0]
    bars, written = bars_on(clock, "ablating heads", {"ablating heads": "heads"})
    with bars:
        clock[0] = 60.0
        bars(0, 40)
        for head in range(1, 41):
            clock[0] += 2.0
            bars(head, 40)
            task = bars.rich.tasks[bars.current]
            remaining = library_progress.left(task)
            assert remaining is None if head < 4 or head == 40 else remaining == 2.0 * (40 - head)
            assert (task.elapsed or 0) + (remaining or 0) >= task.elapsed
    lines = written.getvalue().splitlines()
    found = [re.search(r" (\d+)/40 heads, 0.5/s, (\d+):(\d\d) elapsed(?:, ~(\d+):(\d\d) left)?$", line)
             for line in lines]
    assert all(found) and len(lines) == 10, lines  # a line a tenth, the last at the total
    assert [int(m[4]) * 60 + int(m[5]) for m in found[:-1]] == [2 * (40 - 4 * tenth) for tenth in range(1, 10)]
    assert lines[-1] == "ablating heads 40/40 heads, 0.5/s, 2:20 elapsed"


def test_the_time_left_is_rounded_to_the_nearest_second() -> None:
    """Two of three prompts done at 1.9 s each: about 1.9 s are left, shown as ~0:02, not cut to ~0:01."""
    clock = [0.0]
    bars, written = bars_on(clock, "kv-heads: scoring heads")
    with bars:
        bars(0, 3)
        for done in (1, 2):
            clock[0] += 1.9
            bars(done, 3)
        assert written.getvalue().splitlines()[-1] == "kv-heads: scoring heads 67%, 18%/s, 0:03 elapsed, ~0:02 left"


def test_work_done_in_a_moment_says_nothing() -> None:
    """Ten steps in 0.1 s: no line per step (they would all read `0:00 elapsed, ~0:00 left`), nor at the end."""
    clock = [0.0]
    bars, written = bars_on(clock, "training", {"training": "steps"})
    with bars:
        for step in range(1, 11):
            clock[0] += 0.01
            bars(step, 10)
    assert written.getvalue() == ""


def test_a_step_without_a_count_says_it_is_still_running_every_30_seconds() -> None:
    clock = [0.0]
    bars, written = bars_on(clock, "generating 20 tokens per head and alpha ...", first=cli_progress.ANNOUNCE_AFTER)
    with bars:
        for clock[0] in (1.0, 2.5, 20.0, 31.0, 32.0, 62.0, 100.0):
            bars.tick()
    assert written.getvalue().splitlines() == [
        "generating 20 tokens per head and alpha ... 0:02 elapsed",
        "generating 20 tokens per head and alpha ... 0:31 elapsed",  # 28.5 s after the first: before 30 s
        "generating 20 tokens per head and alpha ... 1:02 elapsed",
        "generating 20 tokens per head and alpha ... 1:40 elapsed"]


def test_the_heartbeat_draws_on_its_own_thread_until_the_block_ends(monkeypatch) -> None:
    """A model's load or one forward reports nothing for minutes: the thread says it runs, and stops with it."""
    import threading

    monkeypatch.setattr(library_progress, "BEAT", 0.01)
    monkeypatch.setattr(library_progress, "EVERY_SECONDS", 0.02)
    written = io.StringIO()
    with library_progress.Bars("loading", first=0.02, console=Console(file=written, width=4096)):
        deadline = time.monotonic() + 60
        while not written.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)  # waits for the thread's line: nothing timed
        assert written.getvalue().startswith("loading ")
    assert not [thread for thread in threading.enumerate() if thread.name == "probe-progress"]


def test_kv_heads_reports_each_stage_on_its_own_to_its_total() -> None:
    """The budget stage took 830 of 892 s under a `scoring heads` bar counted over every stage's steps: each stage
    now reports its own work, so its time left is measured from its own rate."""
    from probe.kv import kv_heads
    from probe.kv.pipeline import STAGE_UNITS as KV_UNITS

    from conftest import tiny_loaded

    reports: list[tuple[str, int, int]] = []
    kv_heads(tiny_loaded("llama_gqa"), lengths=(100,), depths=(0.5,), sink=2, recent=8, steps=2, random_seeds=(0,),
             curve_texts=1, progress=lambda *report: reports.append(report))
    stages = _stages(reports)
    assert list(stages) == ["scoring heads", "calibrating the budget", "checking the order"]
    assert set(stages) <= set(KV_UNITS) and all(counts[0][0] == 0 for counts in stages.values())
    assert all(_ends_at_its_total(counts) for counts in stages.values()), stages


def test_a_sweep_weighs_each_run_by_the_parameters_it_passes() -> None:
    """A sweep's time left follows its work only if a run from a late block weighs what it costs: its blocks and the
    readout (a large vocabulary's unembedding weighs several blocks), not one block per block and one for the
    readout, which left a SmolLM2 sweep's last tenth twice as long as its estimate."""
    from probe.ablation import sweep
    from probe.ablation.blocks import find_blocks
    from probe.hooks.layers import attention_layers
    from probe.inputs import natural_set

    from conftest import tiny_loaded

    loaded = tiny_loaded("llama_gqa")
    reports: list[tuple[int, int]] = []
    sweep(loaded, natural_set(loaded, seq_len=12, num_seqs=2), stack=1, progress=lambda *r: reports.append(r))
    steps = [done - before for (before, _), (done, _) in zip([(0, 0), *reports], reports)]
    blocks, _ = find_blocks(loaded.model, attention_layers(loaded.model))
    assert blocks is not None
    per_block = [sum(p.numel() for p in block.parameters()) for block in blocks.container]
    unembed = loaded.model.get_output_embeddings().weight.numel()
    per_run = [round(1000 * (sum(per_block[start:]) + unembed) / (sum(per_block) + unembed))
               for start in range(len(blocks))]
    assert steps[0] == per_run[0] == 1000 and set(steps[1:]) == set(per_run)  # the baseline, then a run per head
    assert reports[-1][0] == reports[-1][1]


# ---------------------------------------------------------------------------------------------------------------
# every long command on a fake clock: each stage named as it starts, no time left before a tenth of its stage, every
# counted stage ending at its total

WORDS = "tests/words.py:tiny_with_words"
COMMANDS = {
    "classify": ["classify", "--model", PLANTED, "--num-seqs", "2", "--seq-len", "16", "--repeat-len", "8"],
    "ablate": ["ablate", "--model", PLANTED, "--num-seqs", "2", "--seq-len", "16"],
    "prune": ["prune", "--model", PLANTED, "--num-seqs", "2", "--seq-len", "24", "--seeds", "1", "--step", "0.25"],
    "patch": ["patch", "--model", WORDS, "--task", "ioi", "--count", "4"],
    "dla": ["dla", "--model", WORDS, "--task", "ioi", "--count", "4", "--self-repair"],
    "steer": ["steer", "--model", WORDS, "--heads", "1.2,0.1", "--values", "0,2", "--task", "ioi", "--num-seqs", "4",
              "--generate", "the keys", "--max-new-tokens", "3"],
    "kv-heads": ["kv-heads", "--model", f"{TESTS / 'planted.py'}:planted_gpt2", "--lengths", "120", "--depths", "0.5",
                 "--sink", "1", "--recent", "4", "--steps", "2", "--random-seeds", "0", "--curve-texts", "1"],
    "atlas": ["atlas", "--model", "tests/planted.py:planted_lm", "--seq-len", "24", "--num-seqs", "2",
              "--repeat-len", "8"],
    "atlas --fast": ["atlas", "--model", "tests/planted.py:planted_lm", "--seq-len", "24", "--num-seqs", "2",
                     "--repeat-len", "8", "--fast"],
    "circuits": ["circuits", "--model", PLANTED, "--num-seqs", "2", "--seq-len", "16", "--repeat-len", "8"],
    "qk": ["qk", "--model", f"{TESTS / 'planted.py'}:planted_gpt2", "--head", "1.1", "--at", "induction",
           "--num-seqs", "2", "--repeat-len", "8"],
}
STAGES = {  # the stages a command counts, in order
    "kv-heads": ["kv-heads: scoring heads", "kv-heads: calibrating the budget", "kv-heads: checking the order"],
    "circuits": ["circuits: K-composition", "circuits: classifying heads", "circuits: ablation check"],
}
COUNTED = re.compile(r"^(?P<what>.+?) (?:(?P<done>\d+)/(?P<total>\d+) [a-zA-Z/ ]+|(?P<percent>\d+)%), ")


@pytest.mark.slow
@pytest.mark.parametrize("command", list(COMMANDS))
def test_each_long_command_on_a_fake_clock_names_its_stages_and_estimates_only_past_a_tenth(
        command: str, tmp_path: Path, capsys, monkeypatch) -> None:
    on_a_fake_clock(command, COMMANDS[command], tmp_path, capsys, monkeypatch)


def on_a_fake_clock(command: str, args: list[str], tmp_path: Path, capsys, monkeypatch) -> list[str]:
    """`args` run with every look at the clock 4 s later and no heartbeat thread: no time left before a tenth of its
    stage, every counted stage ending at 100%, in order; its stderr lines."""
    slow_clock(monkeypatch)
    monkeypatch.setattr("probe.inputs.contrast.MIN_GAP", 1e-4)  # a random tiny model's corruption changes little
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path))
    monkeypatch.chdir(TESTS.parent)
    code, _, stderr = run_cli([*args, "--json", str(tmp_path / "out.json")], capsys, monkeypatch)
    assert code == 0, stderr
    lines = stderr.splitlines()
    counted = [(found["what"], _percent(found), line) for line in lines if (found := COUNTED.match(line))]
    assert counted or command == "steer", stderr  # steer's chosen heads: steps without a count, each timed
    assert command != "steer" or re.search(r"^generating 3 tokens per head and value: done in", stderr, re.M)
    assert all(percent >= 10 for _, percent, line in counted if " left" in line), stderr
    last: dict[str, int] = {}
    for what, percent, _ in counted:
        last[what] = percent
    assert all(percent == 100 for percent in last.values()), last
    assert list(last)[:len(STAGES.get(command, []))] == STAGES.get(command, []), stderr
    return lines


def _percent(found: re.Match[str]) -> int:
    return int(found["percent"]) if found["percent"] else 100 * int(found["done"]) // int(found["total"])

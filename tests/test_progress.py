"""Progress that says what each stage of a command is doing, in units a user knows, to its total: the circuits'
stages (the ablation check after the classification was silent), the atlas' composition stage (~90 s on SmolLM2,
silent), and the model load and every other uncounted step off a terminal (silent where stderr was a file)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

import probe.cli.options as options
import probe.cli.progress as cli_progress
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


def test_circuits_command_says_what_runs_after_the_classification(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path))
    code, _, stderr = run_cli(["circuits", "--model", PLANTED, "--num-seqs", "2", "--repeat-len", "8", "--seq-len",
                               "16"], capsys, monkeypatch)
    assert code == 0, stderr
    started = [line for line in stderr.splitlines() if line.startswith("circuits: ") and line.endswith(" ...")]
    assert started == ["circuits: K-composition ...", "circuits: classifying heads ...", "circuits: ablation check ..."]


# ---------------------------------------------------------------------------------------------------------------
# atlas: the composition stage counted in layer pairs; every stage named off a terminal


def test_atlas_composition_stage_counts_layer_pairs() -> None:
    reports: list[tuple[str, int, int]] = []
    loaded = LoadedModel(model=planted_lm(), tokenizer=None, name="planted", vocab_size=200)
    atlas(loaded, **SMALL, batch_size=2, progress=lambda *report: reports.append(report))
    stages = _stages(reports)
    assert stages["composition"][-1] == (3, 3) and ATLAS_UNITS["composition"] == UNIT  # 3 kinds x 1 layer pair
    assert list(stages)[:3] == ["classify", "composition", "copying"] and "dla" in stages


def test_stages_off_a_terminal_say_each_stage_and_count_in_its_unit(capsys, monkeypatch) -> None:
    clock = [0.0]
    monkeypatch.setattr(cli_progress.PlainProgress, "__init__", _on_clock(cli_progress.PlainProgress.__init__, clock))
    with cli_progress.stage_progress("atlas: ", {"composition": "layer pairs"}) as update:
        update("composition", 0, 1)
        for done in range(0, 31, 3):
            clock[0] += 2.0
            update("composition", done, 30)
        update("patterns", 0, 1)  # a stage that counts nothing
        clock[0] += 5.0
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "atlas: composition ..." and "atlas: patterns ..." in lines
    counted = [line for line in lines if "layer pairs" in line]
    assert counted[-1] == "atlas: composition: 30/30 layer pairs (100%), 0:22 elapsed"
    assert lines[-1] == "atlas: patterns: 100%, 0:05 elapsed"


def _on_clock(init, clock: list[float]):
    def with_clock(self, description: str, *, unit: str | None = None, now=None, **options) -> None:
        init(self, description, unit=unit, now=lambda: clock[0], **options)
    return with_clock


# ---------------------------------------------------------------------------------------------------------------
# the model load, and every other step without a count: said on a terminal and off it, with its seconds


def _slow_load(seconds: float):
    def load_model(spec: str, **_kwargs) -> LoadedModel:
        time.sleep(seconds)
        return LoadedModel(model=planted_textbook(), tokenizer=None, name=spec, vocab_size=200)
    return load_model


def test_a_slow_load_off_a_terminal_says_so_and_how_long_it_took(capsys, monkeypatch) -> None:
    monkeypatch.setattr(cli_progress, "ANNOUNCE_AFTER", 0.2)
    monkeypatch.setattr(options, "load_model", _slow_load(0.6))
    options.load(options.ModelChoice("planted"))
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "loading planted ..." and re.fullmatch(r"loaded planted in 0\.[6-9] s|loaded planted in "
                                                              r"[1-9]\.\d s", lines[1]) and len(lines) == 2, lines


def test_a_load_in_a_moment_or_with_quiet_says_nothing(capsys, monkeypatch) -> None:
    monkeypatch.setattr(cli_progress, "ANNOUNCE_AFTER", 1.5)  # building the planted model: well under it, even on a
    monkeypatch.setattr(options, "load_model", _slow_load(0.0))  # busy machine
    options.load(options.ModelChoice("planted"))
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(cli_progress, "ANNOUNCE_AFTER", 0.2)
    monkeypatch.setattr(options, "load_model", _slow_load(0.5))
    cli_progress.set_quiet(True)
    options.load(options.ModelChoice("planted"))
    assert capsys.readouterr().err == ""


def test_a_slow_load_on_a_terminal_says_how_long_it_took(monkeypatch) -> None:
    screen = io.StringIO()
    monkeypatch.setattr(cli_progress, "errors", Console(file=screen, force_terminal=True, width=100))
    monkeypatch.setattr(cli_progress, "ANNOUNCE_AFTER", 0.2)
    monkeypatch.setattr(options, "load_model", _slow_load(0.4))
    options.load(options.ModelChoice("planted"))
    assert "loading planted ..." in screen.getvalue() and re.search(r"loaded planted in \d\.\d s", screen.getvalue())


def test_a_step_without_a_count_off_a_terminal_is_said_and_timed(capsys, monkeypatch) -> None:
    monkeypatch.setattr(cli_progress, "ANNOUNCE_AFTER", 0.2)
    with cli_progress.status("capturing attention ..."):
        time.sleep(0.5)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "capturing attention ..." and re.fullmatch(r"capturing attention: done in \d\.\d s", lines[1])
    with pytest.raises(RuntimeError), cli_progress.status("capturing attention ..."):
        raise RuntimeError("at once")
    assert capsys.readouterr().err == ""  # an error in a moment stays the only line: the error's own


# ---------------------------------------------------------------------------------------------------------------
# truthful plain progress: a line at least every 30 s (the heartbeat's tick), a time left only past a tenth


def test_a_stage_silent_for_30_seconds_still_gets_a_line_from_the_heartbeat(capsys) -> None:
    clock = [0.0]
    plain = cli_progress.PlainProgress("kv-heads: calibrating the budget", unit="points", now=lambda: clock[0])
    plain.update(1, 8)  # the unablated point, at once
    for seconds in (10.0, 28.0):
        clock[0] = seconds
        plain.tick()  # under 30 s of silence: nothing
    assert capsys.readouterr().err == ""
    clock[0] = 31.0
    plain.tick()
    clock[0] = 45.0
    plain.tick()
    clock[0] = 61.0
    plain.tick()
    assert capsys.readouterr().err.splitlines() == [  # 1 of 8 done: past a tenth, but no rate measured yet
        "kv-heads: calibrating the budget: 1/8 points (12%), 0:31 elapsed",
        "kv-heads: calibrating the budget: 1/8 points (12%), 1:01 elapsed"]
    clock[0] = 70.0
    plain.update(2, 8)
    assert capsys.readouterr().err.splitlines() == [
        "kv-heads: calibrating the budget: 2/8 points (25%), 1:10 elapsed, ~7:00 left"]  # 70 s per point since 1


def test_no_time_left_before_a_tenth_of_the_stage(capsys) -> None:
    """Patching said `~3:06:39 left` at 0%: a rate from the first units is not one to trust."""
    clock = [0.0]
    plain = cli_progress.PlainProgress("patching heads", now=lambda: clock[0])
    for done in range(1, 100):
        clock[0] += 31.0
        plain.update(done, 1000)  # a line every call (31 s apart), each under a tenth
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 99 and not any("left" in line for line in lines)
    clock[0] += 31.0
    plain.update(100, 1000)
    assert capsys.readouterr().err.strip().endswith("10%, 51:40 elapsed, ~7:45:00 left")  # 900 units at 31 s



def test_the_time_left_is_rounded_to_the_nearest_second(capsys) -> None:
    """Two of three prompts done at 1.9 s each: about 1.9 s are left, shown as ~0:02, not cut to ~0:01 (half the
    truth on a short stage)."""
    clock = [0.0]
    plain = cli_progress.PlainProgress("kv-heads: scoring heads", now=lambda: clock[0])
    plain.update(0, 3)
    for done in (1, 2):
        clock[0] += 1.9
        plain.update(done, 3)
    assert capsys.readouterr().err.splitlines()[-1] == "kv-heads: scoring heads: 66%, 0:03 elapsed, ~0:02 left"


def test_a_step_without_a_count_says_it_is_still_running_every_30_seconds(capsys) -> None:
    clock = [0.0]
    announcer = cli_progress.Announcer("generating 20 tokens per head and alpha ...", now=lambda: clock[0])
    for clock[0] in (1.0, 2.5, 20.0, 31.0, 32.0, 62.0, 100.0):
        announcer.tick()
    assert capsys.readouterr().err.splitlines() == [
        "generating 20 tokens per head and alpha ...",
        "generating 20 tokens per head and alpha: 0:32 elapsed",  # 29.5 s after the first line: within a beat
        "generating 20 tokens per head and alpha: 1:02 elapsed",
        "generating 20 tokens per head and alpha: 1:40 elapsed"]


def test_the_heartbeat_ticks_on_its_own_thread_until_the_block_ends(monkeypatch) -> None:
    import threading

    ticked = threading.Event()
    monkeypatch.setattr(cli_progress, "BEAT", 0.01)
    with cli_progress.heartbeat(ticked.set):
        assert ticked.wait(60)  # a tick came while the block ran (no timing asserted: it waits for it)
    ticked.clear()
    time.sleep(0.05)
    assert not ticked.is_set()  # and none after it


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
STAGES = {  # the stages a command names as each starts, in order
    "kv-heads": ["kv-heads: scoring heads ...", "kv-heads: calibrating the budget ...",
                 "kv-heads: checking the order ..."],
    "circuits": ["circuits: K-composition ...", "circuits: classifying heads ...", "circuits: ablation check ..."],
}
COUNTED = re.compile(r"^(?P<what>.+?): (?:\d+/\d+ [a-z ]+ \()?(?P<percent>\d+)%")


@pytest.mark.parametrize("command", list(COMMANDS))
def test_each_long_command_on_a_fake_clock_names_its_stages_and_estimates_only_past_a_tenth(
        command: str, tmp_path: Path, capsys, monkeypatch) -> None:
    on_a_fake_clock(command, COMMANDS[command], tmp_path, capsys, monkeypatch)


def on_a_fake_clock(command: str, args: list[str], tmp_path: Path, capsys, monkeypatch) -> list[str]:
    """`args` run with every look at the clock 4 s later and no heartbeat thread: each stage named as it starts, no
    time left before a tenth of its stage, every counted stage ending at 100%; its stderr lines."""
    clock = [0.0]

    def fake_clock() -> float:  # every look at the clock: 4 s later
        clock[0] += 4.0
        return clock[0]

    monkeypatch.setattr(cli_progress, "monotonic", fake_clock)
    monkeypatch.setattr(cli_progress, "heartbeat", lambda tick, period=None: contextlib.nullcontext())
    monkeypatch.setattr("probe.inputs.contrast.MIN_GAP", 1e-4)  # a random tiny model's corruption changes little
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path))
    monkeypatch.chdir(TESTS.parent)
    code, _, stderr = run_cli([*args, "--json", str(tmp_path / "out.json")], capsys, monkeypatch)
    assert code == 0, stderr
    lines = stderr.splitlines()
    counted = [(found["what"], int(found["percent"]), line) for line in lines if (found := COUNTED.match(line))]
    assert counted or command == "steer", stderr  # steer's chosen heads: steps without a count, each timed
    assert command != "steer" or re.search(r"^generating 3 tokens per head and value: done in", stderr, re.M)
    assert all(percent >= 10 for _, percent, line in counted if " left" in line), stderr
    assert command != "prune" or " left" not in stderr  # its steps only bound the work (a curve stops at the limit)
    assert not any(" left" in line for line in lines if "checking the order" in line)  # a random order stops early
    assert command != "atlas --fast" or not any(" left" in line for line in lines if "atlas: ablation" in line)
    last: dict[str, int] = {}
    for what, percent, _ in counted:
        last[what] = percent
    assert all(percent == 100 for percent in last.values()), last
    started = [line for line in lines if line.endswith(" ...") and line.startswith(f"{command}: ")]
    assert started == STAGES.get(command, started), stderr
    return lines


# ---------------------------------------------------------------------------------------------------------------
# a long command's plan: what it will run and a range of how long, from one forward of its own batch timed here


def test_a_plan_is_its_forwards_times_one_timed_forward_with_slack(capsys, monkeypatch) -> None:
    import torch

    import probe.cli.plans as plans

    monkeypatch.setattr(plans, "forward_seconds", lambda loaded, batch, batch_size, runs=2: 3.0)
    batch = torch.ones((2, 128), dtype=torch.long)
    said = plans.plan(None, [plans.Work("ablating heads", batch, (10, 20))], 8)  # type: ignore[arg-type]
    assert said == (24.0, 96.0)  # 10 x 3 s x 0.8 .. 20 x 3 s x 1.6
    assert capsys.readouterr().err == "plan: ablating heads: about 24 s-1:36 here (one forward of the batch " \
                                      "timed: 3.00 s)\n"
    monkeypatch.setattr(plans, "forward_seconds", lambda loaded, batch, batch_size, runs=2: 0.1)
    assert plans.plan(None, [plans.Work("a moment", batch, (1, 2))], 8) == pytest.approx((0.08, 0.32))  # type: ignore[arg-type]
    assert capsys.readouterr().err == ""  # under SAID_FROM: nothing said
    cli_progress.set_quiet(True)
    assert plans.plan(None, [plans.Work("quiet", batch, (100, 200))], 8) is None  # type: ignore[arg-type]


@pytest.mark.parametrize("command", ["ablate", "patch", "kv-heads", "prune"])
def test_a_long_command_says_its_plan_before_its_work_starts(command: str, tmp_path: Path, capsys,
                                                             monkeypatch) -> None:
    monkeypatch.setattr("probe.cli.plans.SAID_FROM", 0.0)  # the tiny models' work takes a moment: say it anyway,
    monkeypatch.setattr(cli_progress, "MIN_GAP", 0.0)  # and its progress lines too
    monkeypatch.setattr("probe.inputs.contrast.MIN_GAP", 1e-4)
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path))
    monkeypatch.chdir(TESTS.parent)
    code, _, stderr = run_cli(COMMANDS[command], capsys, monkeypatch)
    assert code == 0, stderr
    lines = stderr.splitlines()
    plans = [index for index, line in enumerate(lines)
             if re.match(r"plan: .+: about [\d: s-]+ here \(one forward", line)]
    work = [index for index, line in enumerate(lines)
            if re.match(r"(ablating heads|patching heads|kv-heads: |pruning)", line)]
    assert len(plans) == 1 and work and plans[0] < work[0], stderr



def test_patching_a_key_plans_one_run_per_key_value_group(tmp_path: Path, capsys, monkeypatch) -> None:
    """A key or value is patched once per key/value group, not per query head: the plan counts the runs the sweep
    makes (it said 3x too long for SmolLM2's keys, 9 query heads on 3 KV heads), every position's sweep included."""
    monkeypatch.setattr("probe.cli.plans.SAID_FROM", 0.0)
    monkeypatch.setattr("probe.inputs.contrast.MIN_GAP", 1e-4)
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path))
    monkeypatch.chdir(TESTS.parent)
    code, _, stderr = run_cli([*COMMANDS["patch"], "--component", "key", "--by-position", "--json",
                               str(tmp_path / "p.json")], capsys, monkeypatch)
    assert code == 0, stderr
    found = re.search(r"\((\d+) key/value groups, one forward each from its layer on, on \d+ x (\d+) tokens\)", stderr)
    assert found is not None, stderr
    groups = 2 * 2  # the words model: 2 layers of 2 key/value heads (4 query heads)
    assert int(found[1]) == groups * (1 + int(found[2]))  # one sweep, then one per position
    payload = json.loads((tmp_path / "p.json").read_text())
    assert len({(entry["layer"], entry["head"]) for entry in payload["heads"]}) == 2 * 4  # reported per query head


def test_a_plan_that_cannot_time_its_forward_says_nothing_and_leaves_the_refusal_to_the_work(capsys) -> None:
    import torch

    import probe.cli.plans as plans

    class Refusing(torch.nn.Module):
        def forward(self, input_ids):
            raise ValueError("past the model's positions")

    loaded = LoadedModel(model=Refusing(), tokenizer=None, name="refusing", vocab_size=10)
    assert plans.plan(loaded, [plans.Work("x", torch.ones((1, 8), dtype=torch.long), (100, 200))], 1) is None
    assert capsys.readouterr().err == ""

"""Progress that says what each stage of a command is doing, in units a user knows, to its total: the circuits'
stages (the ablation check after the classification was silent), the atlas' composition stage (~90 s on SmolLM2,
silent), and the model load and every other uncounted step off a terminal (silent where stderr was a file)."""

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
    def with_clock(self, description: str, *, unit: str | None = None, now=None) -> None:
        init(self, description, unit=unit, now=lambda: clock[0])
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

"""One `progress` argument across the library: every public function that takes it takes True (rich's bars on
stderr, a line at least every 30 s off a terminal while the call runs), a callable or None, through
`probe.progress.reports`; each draws its bar on a tiny model, and patch_heads' is drawn by the heartbeat while its
sweep reports nothing."""

from __future__ import annotations

import ast
import io
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from conftest import tiny_loaded
from rich.console import Console

import probe.progress as library_progress
from probe.ablation import estimate, sweep
from probe.ablation.prune import prune
from probe.ablation.window import WindowAblation
from probe.circuits.composition import composition_scores
from probe.heads.classify import score_heads
from probe.inputs import NeedleOptions, natural_set, needle_set, repeated_set
from probe.kv import CURVE_SEED_OFFSET, calibrate_budget, kv_heads, loss_order, score_needles, stream_curve
from probe.kv.pipeline import _held_out
from probe.models import LoadedModel
from probe.patching import patch_heads
from probe.qk import qk_attribution
from probe.syntax import read_conllu, syntax_scores

PROBE = Path(__file__).resolve().parents[1] / "probe"
DRAWN = re.compile(r" (100%|(\d+)/\2 [a-zA-Z ]+), [^\n]*\d+:\d\d elapsed\n$")  # a stage's last line: at its total


@pytest.fixture
def slow_clock(monkeypatch) -> Iterator[None]:
    """Every look at the bars' clock 1 s later (a tiny model's call takes a moment: its last line is said only
    after a second), and no heartbeat thread looking at it."""
    clock = [0.0]

    def later() -> float:
        clock[0] += 1.0
        return clock[0]

    monkeypatch.setattr(library_progress, "monotonic", later)
    monkeypatch.setattr(library_progress, "BEAT", 1e6)
    yield


# ---------------------------------------------------------------------------------------------------------------
# every public function with a `progress` parameter: a keyword, one of the two types, under `reports`


def _public_functions_taking_progress() -> list[tuple[str, ast.FunctionDef]]:
    found = []
    for path in sorted(PROBE.rglob("*.py")):
        if path.name == "progress.py" and path.parent == PROBE:
            continue  # the helpers themselves
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            arguments = node.args if isinstance(node, ast.FunctionDef) else None
            if arguments is None or node.name.startswith("_"):
                continue
            if "progress" in [a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs]:
                found.append((f"{path.relative_to(PROBE.parent)}:{node.name}", node))
    return found


def test_every_public_function_taking_progress_takes_the_one_argument_under_reports() -> None:
    found = _public_functions_taking_progress()
    assert len(found) >= 18, [name for name, _ in found]  # the scan sees them (classify, sweep, kv_heads, ...)
    for name, node in found:
        (argument,) = [a for a in node.args.kwonlyargs if a.arg == "progress"] or [None]
        assert argument is not None, f"{name}: progress is not keyword-only (reports reads it as a keyword)"
        kind = ast.unparse(argument.annotation) if argument.annotation is not None else ""
        assert kind in ("ProgressArg", "StageProgressArg"), f"{name}: progress: {kind}"
        decorators = [ast.unparse(decorator) for decorator in node.decorator_list]
        label = [d for d in decorators if re.fullmatch(r"reports\('[^']+'(, stages=True)?\)", d)]
        assert label, f"{name}: no @reports(label): progress=True would get no bar or no heartbeat"
        assert ("stages=True" in label[0]) == (kind == "StageProgressArg"), f"{name}: {label[0]} for {kind}"


# ---------------------------------------------------------------------------------------------------------------
# progress=True draws each function's bar on stderr, to its total


def _llama() -> torch.nn.Module:
    import transformers as tf

    return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=120, hidden_size=64, intermediate_size=128,
                                              num_hidden_layers=3, num_attention_heads=4)).eval()


def _syntax(tmp_path: Path) -> None:
    from planted_syntax import conllu_corpus, planted_syntax

    corpus = tmp_path / "parses.conllu"
    corpus.write_text(conllu_corpus(4), encoding="utf-8")
    syntax_scores(planted_syntax(), read_conllu(corpus), scheme="ud", source="t", batch_size=2, min_count=1,
                  progress=True)


def _patch(monkeypatch: pytest.MonkeyPatch, run: Callable[..., object] = sweep) -> None:
    from test_patching import ioi_runs
    from test_specific import words_loaded

    monkeypatch.setattr("probe.inputs.contrast.MIN_GAP", 1e-3)  # a random tiny model's corruption changes little
    loaded = words_loaded()
    clean, corrupt = ioi_runs(loaded, count=4)
    patch_heads(loaded, clean, corrupt, [(0, 1), (1, 2)], batch_size=4, run=run, progress=True)


def _kv_inputs(loaded: LoadedModel):
    return _held_out(loaded, NeedleOptions(seed=0, lengths=(100,), depths=(0.5,)), None, 1, 0, CURVE_SEED_OFFSET,
                     WindowAblation(sink=2, recent=8))


ORDER = [(layer, kv) for layer in range(2) for kv in range(2)]  # tiny llama_gqa: 2 layers x 2 KV heads
CALLS: dict[str, Callable[[LoadedModel, Path, pytest.MonkeyPatch], object]] = {
    "scoring heads": lambda loaded, _, __: score_heads(loaded, repeated_set(loaded, repeat_len=4, num_seqs=2),
                                                       ["previous_token"], batch_size=1, progress=True),
    "estimating": lambda loaded, _, __: estimate(loaded, natural_set(loaded, seq_len=12, num_seqs=2), progress=True),
    "pruning": lambda loaded, _, __: prune(loaded, repeated_set(loaded, repeat_len=4, num_seqs=2),
                                           orderings=("random",), seeds=(0,), step=0.5, progress=True),
    "composition": lambda _, __, ___: composition_scores(_llama(), progress=True),
    "qk attribution": lambda loaded, _, __: qk_attribution(loaded, torch.randint(3, 100, (2, 10)), (1, 1),
                                                           progress=True),
    "scoring sentences": lambda _, tmp_path, __: _syntax(tmp_path),
    "patching heads": lambda _, __, monkeypatch: _patch(monkeypatch),
    "scoring heads (kv)": lambda loaded, _, __: score_needles(
        loaded, needle_set(loaded, NeedleOptions(lengths=(100,), depths=(0.5,))), sink=2, recent=8, progress=True),
    "ordering by loss": lambda loaded, _, __: loss_order(
        loaded, torch.zeros(2, 2), natural_set(loaded, seq_len=99, num_seqs=1), WindowAblation(sink=2, recent=8),
        progress=True),
    "calibrating the budget": lambda loaded, _, __: calibrate_budget(loaded, ORDER, _kv_inputs(loaded),
                                                                     max_loss_increase=1e9, progress=True),
    "checking the order": lambda loaded, _, __: stream_curve(loaded, ORDER, _kv_inputs(loaded), [0, 2, 4], [0],
                                                             progress=True, stop_below=None),
}


@pytest.mark.parametrize("label", list(CALLS))
def test_progress_true_draws_the_functions_bar_on_stderr_to_its_total(label: str, tmp_path: Path, capsys,
                                                                      monkeypatch, slow_clock) -> None:
    CALLS[label](tiny_loaded("llama_gqa"), tmp_path, monkeypatch)
    drawn = capsys.readouterr().err
    name = label.removesuffix(" (kv)")
    assert drawn and all(line.startswith(f"{name} ") for line in drawn.splitlines()), drawn
    assert "\r" not in drawn and "\x1b" not in drawn  # off a terminal: lines
    assert DRAWN.search(drawn), drawn
    assert not [thread for thread in threading.enumerate() if thread.name == "probe-progress"]  # ended with the call


def test_kv_heads_progress_true_draws_a_bar_per_stage(capsys, slow_clock) -> None:
    kv_heads(tiny_loaded("llama_gqa"), lengths=(100,), depths=(0.5,), sink=2, recent=8, steps=2, random_seeds=(0,),
             curve_texts=1, progress=True)
    lines = capsys.readouterr().err.splitlines()
    for stage in ("scoring heads", "calibrating the budget", "checking the order"):
        said = [line for line in lines if line.startswith(f"kv-heads: {stage} ")]
        assert said and DRAWN.search(said[-1] + "\n"), lines  # each stage's own lines, its last at its total


def test_progress_true_on_a_terminal_draws_rich_bars_with_a_time_left(monkeypatch) -> None:
    screen = io.StringIO()
    monkeypatch.setattr(library_progress, "Console", lambda **_: Console(file=screen, force_terminal=True, width=120))
    clock = [0.0]
    monkeypatch.setattr(library_progress, "monotonic", lambda: clock[0])

    @library_progress.reports("counting")
    def count(*, progress: library_progress.ProgressArg = None) -> None:
        assert callable(progress)
        for done in range(11):
            clock[0] += 2.0
            progress(done, 10)

    count(progress=True)
    drawn = screen.getvalue()
    assert "\x1b" in drawn and "counting" in drawn and "━" in drawn  # rich's live bar
    assert "100%" in drawn


def test_a_callable_is_the_callers_own(capsys) -> None:
    """The CLI passes callables: they get the counts, and nothing is drawn."""
    reports: list[tuple[int, int]] = []
    composition_scores(_llama(), progress=lambda *report: reports.append(report))
    assert reports[0] == (0, 3 * 3) and reports[-1] == (9, 9) and capsys.readouterr().err == ""


# ---------------------------------------------------------------------------------------------------------------
# patch_heads' bar: drawn by the heartbeat while the work reports nothing, on a fake clock


def test_patch_heads_bar_is_drawn_by_the_heartbeat_while_its_sweep_reports_nothing(capsys, monkeypatch) -> None:
    clock = [0.0]
    tick = library_progress.Bars.tick
    drew = threading.Event()

    def ticked(self: library_progress.Bars) -> None:
        tick(self)
        if self.said is not None:
            drew.set()

    monkeypatch.setattr(library_progress, "monotonic", lambda: clock[0])
    monkeypatch.setattr(library_progress.Bars, "tick", ticked)
    monkeypatch.setattr(library_progress, "BEAT", 0.01)

    def after_31_silent_seconds(*args, **options):
        clock[0] = 31.0  # the baselines took 31 s, and nothing was reported but the start
        assert drew.wait(60), "no heartbeat drew the bar"  # it waits for the thread: nothing timed
        return sweep(*args, **options)

    _patch(monkeypatch, run=after_31_silent_seconds)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "patching heads 0:31 elapsed", lines  # before any report: that it runs, and how long
    assert DRAWN.search(lines[-1] + "\n"), lines
    assert not [thread for thread in threading.enumerate() if thread.name == "probe-progress"]


def test_under_torchrun_only_the_first_process_draws_its_bar(capsys, monkeypatch) -> None:
    """Every process of a torchrun job runs the same call; bars on each would print every process's lines, each of
    its own share of the sweep."""
    seen: list[object] = []
    work = library_progress.reports("working")(lambda *, progress=None: seen.append(progress))
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        work(progress=True)
    assert seen[0] is None and isinstance(seen[1], library_progress.Bars)
    assert not [thread for thread in threading.enumerate() if thread.name == "probe-progress"]

"""`python -m bench.tour`: the README's steps parsed with their stated times, the longest silence found from the
times lines came, and a tour run end to end on a planted model: each step in its own process, a step past its
timeout stopped and marked, every result saved as it comes. A document's `probe` lines (`--doc`): read, those that
cannot run here offline skipped with the reason; getting-started's runnable lines each parse as the CLI reads them
(with its checks before loading) and state a time."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

import pytest

from bench import report, tour
from bench.common import tour_result

TESTS = Path(__file__).parent
ROOT = TESTS.parent
PLANTED = f"{TESTS / 'planted.py'}:planted_textbook"
README = f"""# a readme

## CLI tour

```bash
probe classify --model {PLANTED} --num-seqs 2 --seq-len 16 --repeat-len 8 --json heads.json  # scores (under 1 min)
probe schema classify                          # its JSON Schema (under 10 s)
```

## Python API

```python
# the whole block: under 2 min
print("the block ran")
```
"""


DOC = f"""# a guide

```bash
bash install.sh && .venv/bin/probe classify
```

```bash
probe classify --model tests/planted.py:planted_textbook --num-seqs 2 --seq-len 16 --repeat-len 8  # (under 1 min)
probe classify --model org/name --trust-remote-code   # a hub model
probe classify --model path/to/hf-folder
probe classify --data my.txt --seq-len 256
probe syntax --conllu en_ewt-ud-dev.conllu --json s.json
probe ablate --data repeated --model {PLANTED}  # (under 20 s)
```
"""


def test_every_tour_command_states_a_time_under_four_minutes_and_the_python_block_one() -> None:
    *commands, block = tour.steps(tour.README.read_text(encoding="utf-8"))
    assert block.name == "python" and block.stated is not None and len(commands) >= 12
    assert all(step.stated is not None and step.stated <= 240 for step in commands), \
        [step.line for step in commands if step.stated is None or step.stated > 240]


def test_steps_read_the_commands_their_times_and_the_python_block() -> None:
    found = tour.steps(README)
    assert [(step.name, step.stated) for step in found] == [("classify", 60.0), ("schema", 10.0), ("python", 120.0)]
    assert found[0].line.startswith("probe classify") and "#" not in found[0].line
    assert found[2].line.startswith("# the whole block")


def test_quick_python_gives_each_call_small_inputs_and_keeps_the_rest() -> None:
    code = "swept = sweep(loaded, natural_set(loaded, num_seqs=2), progress=True)\natlas(loaded, fast=True).to_dict()\n"
    assert tour.quick_python(code) == (
        "swept = sweep(loaded, natural_set(loaded, seq_len=8, num_seqs=1), progress=True)\n"
        "atlas(loaded, fast=True, num_seqs=1, seq_len=16, repeat_len=8).to_dict()\n")


def test_the_longest_silence_counts_the_start_and_the_end_as_lines() -> None:
    assert tour.longest_silence([2.0, 5.0, 35.0, 80.0, 90.0], 95.0) == 45.0  # 35 s -> 80 s
    assert tour.longest_silence([], 12.5) == 12.5  # a step that printed nothing: silent throughout
    assert tour.longest_silence([1.0], 40.0) == 39.0  # the last line to the end


@pytest.mark.slow
def test_a_bar_redrawn_in_place_counts_as_lines(tmp_path: Path) -> None:
    """A bar that rewrites its line with a carriage return shows the step alive each time it is drawn."""
    code = "import sys, time\nfor part in ('1/3\\r', '2/3\\r', '3/3\\n'):\n    time.sleep(1)\n" \
           "    sys.stderr.write(part)\n    sys.stderr.flush()\n"
    outcome = tour.run_step(tour.Step("python", code, None), tmp_path, timeout=60)
    assert outcome.code == 0 and outcome.tail == ["1/3", "2/3", "3/3"], outcome
    assert outcome.gap <= outcome.seconds - 1.5  # a draw each second, not one silence of three seconds


@pytest.mark.slow
def test_a_tour_runs_each_step_in_its_own_process_and_saves_as_it_goes(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path / "cache"))
    saved: list[int] = []
    data = tour.run(timeout=600, text=README, log=lambda text: None,
                    save=lambda data: saved.append(len(data["rows"])))
    rows = data["rows"]
    assert saved == [1, 2, 3] and [row["name"] for row in rows] == ["classify", "schema", "python"]
    assert [row["code"] for row in rows] == [0, 0, 0] and not any(row["timed_out"] for row in rows), rows
    assert all(0 <= row["gap"] <= row["seconds"] for row in rows)
    sleeping = tour.run_step(tour.Step("python", "import time\ntime.sleep(600)", 60.0), tmp_path, timeout=1)
    assert sleeping.timed_out and sleeping.code is None  # stopped at its timeout, its process gone
    data["rows"].append(dataclasses.asdict(sleeping) | {"load": (0.0, 0.0, 0.0)})
    text = report.tour(data)
    assert text.count("\n| `") == 4 and "| timeout |" in text and "**no**" in text


def test_a_server_is_timed_to_its_ready_line_and_then_stopped(tmp_path: Path, monkeypatch) -> None:
    """A command that serves until stopped counts the time to its ready line (on stdout), then gets a Ctrl-C."""
    monkeypatch.setitem(tour.READY, "python", tour.READY["serve"])
    code = "import time\ntime.sleep(1)\nprint('serving m: open http://127.0.0.1:1/', flush=True)\ntime.sleep(600)\n"
    outcome = tour.run_step(tour.Step("python", code, 60.0), tmp_path, timeout=120)
    assert outcome.ready and not outcome.timed_out and 1 <= outcome.seconds < 30, outcome
    assert outcome.code != 0 and "KeyboardInterrupt" in outcome.tail[-1]  # stopped by the Ctrl-C, not by itself


def test_a_busy_run_starts_its_busy_processes_and_stops_them(monkeypatch) -> None:
    readme = "## CLI tour\n\n```bash\n```\n\n## Python API\n\n```python\nprint('ok')\n```\n"
    started: list = []
    real = tour.busy_processes

    def spy(count: int) -> list:
        started.extend(real(count))
        assert all(spinner.poll() is None for spinner in started)  # running while the steps run
        return started

    monkeypatch.setattr(tour, "busy_processes", spy)
    data = tour.run(timeout=60, text=readme, log=lambda text: None, busy=2)
    assert data["busy"] == 2 and [row["code"] for row in data["rows"]] == [0] and len(started) == 2
    assert all(spinner.poll() is not None for spinner in started)  # stopped with the run

def test_a_documents_probe_lines_are_read_and_those_that_need_what_is_not_here_skipped_with_why(
        tmp_path: Path) -> None:
    found = tour.doc_steps(DOC)
    assert [(step.name, step.stated) for step in found] == [
        ("classify", 60.0), ("classify", None), ("classify", None), ("classify", None), ("syntax", None),
        ("ablate", 20.0)]
    assert tour.skip_reason(found[0].line, tmp_path) == "needs a model of yours: tests/planted.py:planted_textbook"
    tour.copy_clone_files(tmp_path, found)  # the clone's file the line names: now it runs as from a clone
    assert (tmp_path / "tests" / "planted.py").read_bytes() == (TESTS / "planted.py").read_bytes()
    assert [tour.skip_reason(step.line, tmp_path) for step in found] == [
        None, "needs the hub: org/name is a hub id", "needs a model of yours: path/to/hf-folder",
        "needs a file of yours: --data my.txt", "needs a file of yours: --conllu en_ewt-ud-dev.conllu", None]


@pytest.mark.slow
def test_a_documents_tour_runs_its_runnable_lines_and_lists_the_others(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path / "cache"))
    data = tour.run(timeout=600, text=DOC, doc="docs/guide.md", log=lambda text: None, only=["classify"])
    assert [(row["name"], row["code"], row["stated"]) for row in data["rows"]] == [("classify", 0, 60.0)]
    assert [entry["reason"].split(":")[0] for entry in data["skipped"]] == [
        "needs the hub", "needs a model of yours", "needs a file of yours", "needs a file of yours"]
    text = report.tour(data)
    assert text.startswith("## docs/guide.md's commands") and text.count("\n| `") == 1
    assert "- `probe classify --model org/name --trust-remote-code`: needs the hub" in text
    assert tour_result("docs/guide.md") == "tour-guide" and tour_result(None) == "tour"


def parse(line: str) -> None:
    """A `probe ...` line parsed as the CLI parses it, and its checks before the model loads (a renamed flag, a bad
    value, a layer past the model's), without running the command."""
    import typer

    from probe.cli.app import app
    from probe.cli.checks import check_before_loading

    name, *rest = shlex.split(line)[1:]
    command = typer.main.get_command(app).commands[name]
    with command.make_context(name, rest) as context:
        check_before_loading(context.params)


def test_every_runnable_getting_started_line_parses_and_states_a_time(tmp_path: Path, monkeypatch) -> None:
    """The lines `python -m bench.tour --doc docs/getting-started.md` runs here (those it skips need a file, a model
    or a package of the user's) each state a time, the README tour's where it is the README's line, and parse."""
    doc = tour.doc_steps((ROOT / "docs" / "getting-started.md").read_text(encoding="utf-8"))
    readme = dict(tour.tour_lines(tour.README.read_text(encoding="utf-8")))
    tour.copy_clone_files(tmp_path, doc)
    monkeypatch.chdir(tmp_path)
    runnable = [step for step in doc if tour.skip_reason(step.line, tmp_path) is None]
    assert len(runnable) >= 18 and len(doc) - len(runnable) >= 5
    assert [step.line for step in runnable if step.stated is None] == []
    assert [step.line for step in runnable if step.line in readme
            and step.stated != tour._seconds(readme[step.line])] == []
    for step in runnable:
        parse(step.line)

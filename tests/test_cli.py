"""The `probe` command as a user meets it: exit codes (Ctrl-C included, as a real SIGINT), outputs that may not
replace each other, strict JSON and a warning when a model yields NaN, library messages that name flags, -h,
--version, -q and -v, plain progress lines and unwrapped reports where the output is not a terminal, honest
ablation reports, and one short and one long name of a head."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest
import typer
from rich.console import Console

from probe.cli.app import DISTRIBUTION, app, flag_message
from conftest import run_cli, tiny_loaded
from probe.ablation import estimate, sweep
from probe.inputs import repeated_set
from probe.errors import ProbeError
from probe.reports.files import write_csv, write_json, write_text
from probe.schemas import header
from probe.reports.html import ablation_page
from probe.reports.labels import column_label, long_label, short_label
from probe.reports.terminal import ablation_report

TESTS = Path(__file__).parent
ROOT = TESTS.parent
SLOW = f"{TESTS / 'faulty.py'}:planted_slow"
NAN = f"{TESTS / 'faulty.py'}:planted_nan"
PLANTED = f"{TESTS / 'planted.py'}:planted_textbook"
SMALL = ["--data", "repeated", "--num-seqs", "2", "--repeat-len", "8"]


def strict_json(path: Path) -> dict:
    """Parse as a strict parser would: NaN, Infinity and -Infinity are not JSON."""
    def refuse(constant: str) -> None:
        raise AssertionError(f"{path} holds {constant}, which is not JSON")

    return json.loads(path.read_text(encoding="utf-8"), parse_constant=refuse)


def start(args: list[str], tmp_path: Path, **env: str) -> subprocess.Popen:
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "PROBE_CACHE": str(tmp_path / "cache"), **env}
    return subprocess.Popen([sys.executable, "-m", "probe.cli", *args], cwd=ROOT, env=environment,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_interruptible)


def _interruptible() -> None:
    """In the child before it runs probe: SIGINT back to its default, so that Python turns it into
    KeyboardInterrupt even where the test run itself was started with SIGINT ignored (a shell's background job)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for(condition, process: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the run never got going"
        time.sleep(0.05)


def lines(path: Path) -> int:
    return path.read_text(encoding="utf-8").count("\n") if path.exists() else 0


# ---------------------------------------------------------------------------------------------------------------
# Ctrl-C: exit 130, after saving what finished


@pytest.mark.slow
def test_sigint_during_classify_exits_130_and_writes_nothing(tmp_path: Path) -> None:
    log, out = tmp_path / "forwards.log", tmp_path / "heads.json"
    process = start(["classify", "--model", SLOW, "--num-seqs", "2", "--json", str(out)], tmp_path,
                    PROBE_TEST_FORWARD_LOG=str(log))
    wait_for(lambda: lines(log) >= 1, process)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == "interrupted" and "Traceback" not in stderr
    assert not out.exists()


@pytest.mark.slow
def test_sigint_during_a_sweep_exits_130_and_resume_finishes_it(tmp_path: Path) -> None:
    results, out = tmp_path / "sweep.jsonl", tmp_path / "sweep.json"
    args = ["ablate", "--model", SLOW, *SMALL, "--stack", "1", "--results", str(results)]
    process = start([*args, "--json", str(out)], tmp_path, PROBE_TEST_SLEEP="0.3")
    wait_for(lambda: lines(results) >= 3, process)  # the header and at least two finished heads
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    said = [line for line in stderr.splitlines() if "interrupted" in line]  # one clean line, no bare second one
    assert len(said) == 1 and said[0].startswith("interrupted; ") and "finished ablation(s) saved in" in said[0]
    assert "--resume" in said[0] and stderr.strip().splitlines()[-1] == said[0], stderr
    assert not out.exists()
    saved = lines(results) - 1
    assert 2 <= saved < 8
    process = start([*args, "--resume", "--json", str(out)], tmp_path, PROBE_TEST_SLEEP="0")
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr
    assert f"resumed: {saved} ablation(s)" in stderr and len(strict_json(out)["heads"]) == 8


def test_keyboard_interrupt_in_process_is_130(capsys, monkeypatch) -> None:
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("probe.cli.classify.run_classify", interrupted)
    code, _, stderr = run_cli(["classify", "--model", PLANTED], capsys, monkeypatch)
    assert code == 130 and stderr.strip() == "interrupted"


# ---------------------------------------------------------------------------------------------------------------
# one output may not replace another; every output is written atomically


@pytest.mark.parametrize("args, flags", [
    (["classify", "--json", "{out}", "--html", "{out}"], ("--json", "--html")),
    (["classify", "--json", "out.json", "--html", "./out.json"], ("--json", "--html")),
    (["ablate", "--csv", "{out}", "--json", "{out}"], ("--json", "--csv")),
    (["ablate", "--results", "{out}", "--json", "{out}"], ("--json", "--results")),
    (["ablate", "--html", "{out}", "--results", "{out}"], ("--html", "--results")),
])
def test_two_outputs_at_one_path_are_refused_before_any_work(args: list[str], flags: tuple[str, str],
                                                              tmp_path: Path, capsys, monkeypatch) -> None:
    def never(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("probe.cli.classify.load", never)
    monkeypatch.setattr("probe.cli.options.load", never)
    monkeypatch.chdir(tmp_path)
    filled = [arg.format(out=tmp_path / "out.json") for arg in args]
    code, _, stderr = run_cli([*filled, "--model", PLANTED], capsys, monkeypatch)
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert f"{flags[0]} and {flags[1]} both name" in stderr
    assert not (tmp_path / "out.json").exists()


def test_every_output_file_is_written_by_a_rename(tmp_path: Path, capsys, monkeypatch) -> None:
    renamed = []
    original = os.replace
    monkeypatch.setattr("probe.reports.files.os.replace",
                        lambda src, dst: renamed.append(Path(dst)) or original(src, dst))
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path / "cache"))  # the results stream is renamed too: elsewhere
    outputs = {flag: tmp_path / f"sweep.{flag[2:]}" for flag in ("--json", "--csv", "--html")}
    code, _, stderr = run_cli(["ablate", "--model", PLANTED, *SMALL, *(x for pair in outputs.items()
                                                                       for x in map(str, pair))], capsys, monkeypatch)
    assert code == 0, stderr
    written = [*outputs.values(), tmp_path / "sweep.provenance.json"]  # the CSV's provenance beside it
    assert sorted(path for path in renamed if path.parent == tmp_path) == sorted(written)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left


def test_csv_rows_as_csv(tmp_path: Path) -> None:
    loaded = tiny_loaded("llama_gqa")
    result = sweep(loaded, repeated_set(loaded, repeat_len=8, num_seqs=2), [(0, 0), (1, 1)],
                   groups=[[(0, 0), (1, 1)]])
    write_csv(tmp_path / "r.csv", result.csv_rows())
    text = (tmp_path / "r.csv").read_text(encoding="utf-8")
    assert text.splitlines()[0] == ("name,loss,delta,first_repeat_loss,first_repeat_delta,"
                                    "second_repeat_loss,second_repeat_delta,mean_delta,max_sequence_delta,"
                                    "p99_token_delta,max_token_delta,specificity")  # a group: no layer, head
    rows = list(csv.DictReader(io.StringIO(text)))
    assert [row["name"] for row in rows] == [row["name"] for row in result.csv_rows()]
    assert "L0H0+L1H1" in [row["name"] for row in rows]
    assert [float(row["delta"]) for row in rows] == [row["delta"] for row in result.csv_rows()]


def test_an_interrupted_write_leaves_no_file(tmp_path: Path, monkeypatch) -> None:
    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr("probe.reports.files.os.replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_text(tmp_path / "page.html", "<html>" * 1000)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------------------------
# NaN: strict JSON, one warning, files before reports, charts that do not crash


def test_nan_attention_gives_strict_json_and_one_warning(tmp_path: Path, capsys, monkeypatch) -> None:
    out = tmp_path / "heads.json"
    code, _, stderr = run_cli(["classify", "--model", NAN, "--num-seqs", "2", "--json", str(out)], capsys,
                              monkeypatch)
    assert code == 0, stderr
    data = strict_json(out)
    by_head = {(h["layer"], h["head"]): h for h in data["heads"]}
    assert by_head[(1, 3)]["scores"]["induction"] is None and by_head[(1, 3)]["labels"] == []
    assert by_head[(1, 1)]["scores"]["induction"] > 0.8  # the other heads are scored as ever
    warnings = [line for line in stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "for 1.3;" in warnings[0] and "gave NaN or infinity there" in warnings[0]


@pytest.mark.slow
def test_files_are_written_before_the_terminal_report(tmp_path: Path) -> None:
    """A report that fails to print (a closed pipe, a crash) must not cost the results."""
    out = tmp_path / "heads.json"
    completed = subprocess.run([sys.executable, "-m", "probe.cli", "classify", "--model", NAN, "--num-seqs", "2",
                                "--json", str(out)],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
                               env={**os.environ, "PYTHONPATH": str(ROOT), "PROBE_CACHE": str(tmp_path)})
    assert completed.returncode == 0, completed.stdout
    output = completed.stdout
    assert output.index(f"wrote {out}") < output.index("warning:") < output.index("Head classification of")
    assert strict_json(out)["heads"][-1]["scores"]["induction"] is None


def test_a_nan_baseline_is_refused_where_the_forward_first_went_nan(tmp_path: Path, capsys, monkeypatch) -> None:
    """Head 1.3's NaN queries make every logit NaN, so every delta would be measured from NaN: the sweep refuses in
    one line naming the module (probe.overflow), and writes nothing."""
    out = tmp_path / "sweep.json"
    code, _, stderr = run_cli(["ablate", "--model", NAN, *SMALL, "--json", str(out)], capsys, monkeypatch)
    assert code == 2 and not out.exists()
    assert stderr.strip().splitlines()[-1] == (
        "error: the unablated model's cross_entropy came out NaN or infinite, because the model's own float32 forward "
        "does (first in layers.1.W_q): its weights or inputs are broken")


def test_a_nan_delta_renders_without_crashing(tmp_path: Path) -> None:
    loaded = tiny_loaded("llama_gqa")
    payload = sweep(loaded, repeated_set(loaded, repeat_len=8, num_seqs=2)).to_dict()
    payload["heads"][2]["delta"] = math.nan
    payload["heads"][5]["delta"] = math.inf
    console = Console(record=True, width=160, file=io.StringIO())
    ablation_report(payload, console, top=8)
    text = console.export_text()
    row = next(line for line in text.splitlines() if line.startswith(" 0.2 "))
    assert "nan" in row and "█" not in row
    write_json(tmp_path / "a.json", payload, schema=header("ablate"))
    data = strict_json(tmp_path / "a.json")
    assert data["heads"][2]["delta"] is None and data["heads"][5]["delta"] is None


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_thresholds_are_refused(value: str, capsys, monkeypatch) -> None:
    code, _, stderr = run_cli(["classify", "--model", PLANTED, "--threshold", f"induction={value}"], capsys,
                              monkeypatch)
    assert code == 2 and len(stderr.strip().splitlines()) == 1
    assert "must be a finite number" in stderr


# ---------------------------------------------------------------------------------------------------------------
# messages and exit codes


def test_a_library_parameter_is_shown_as_the_flag_its_command_declares() -> None:
    commands = typer.main.get_command(app).commands
    classify, heatmap = commands["classify"].params, commands["heatmap"].params
    error = ProbeError("seq_len must be at least 2, got 1", parameter="seq_len")
    assert flag_message(error, classify) == "--seq-len must be at least 2, got 1"
    error = ProbeError("heads: 0.9 is out of range: the model has 4 heads", parameter="heads")
    assert flag_message(error, commands["ablate"].params) == "--heads: 0.9 is out of range: the model has 4 heads"
    error = ProbeError("start must be a position", parameter="start")
    assert flag_message(error, heatmap) == "--window-start must be a position"
    assert flag_message(error, classify) == "start must be a position"  # classify has no option that sets it
    error = ProbeError("thresholds: the threshold of x must be a finite number", parameter="thresholds")
    assert flag_message(error, classify).startswith("--threshold: the threshold of x")
    assert flag_message(ProbeError("max_memory is odd", parameter="max_memory"), classify) == "max_memory is odd"
    assert flag_message(ProbeError("plain"), classify) == "plain"


def test_library_errors_reach_the_command_line_with_flags(capsys, monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise ProbeError("num_seqs must be at least 1, got 0", parameter="num_seqs")

    code, _, stderr = run_cli(["classify", "--model", PLANTED, "--seq-len", "1"], capsys, monkeypatch)
    assert code == 2 and "--seq-len must be at least 2" in stderr
    monkeypatch.setattr("probe.cli.classify.run_classify", refuse)
    code, _, stderr = run_cli(["classify", "--model", PLANTED, "--num-seqs", "0"], capsys, monkeypatch)
    assert code == 2 and stderr.strip() == "error: --num-seqs must be at least 1, got 0"


@pytest.mark.parametrize("args, code, message", [
    (["classify", "--seq-len", "x"], 2, "error: Invalid value for '--seq-len'"),
    (["nosuch"], 2, "error: No such command 'nosuch'"),
    (["classify", "--no-such-flag"], 2, "error: No such option: --no-such-flag"),
    (["heatmap", "--text", "a"], 2, "error: give --html PAGE, --json FILE or both"),
])
def test_usage_errors_keep_their_code_in_one_line(args: list[str], code: int, message: str, capsys,
                                                  monkeypatch) -> None:
    got, _, stderr = run_cli(args, capsys, monkeypatch)
    assert got == code and len(stderr.strip().splitlines()) == 1 and stderr.startswith(message), stderr


def test_bare_probe_shows_the_help_and_no_error_line(capsys, monkeypatch) -> None:
    code, stdout, stderr = run_cli([], capsys, monkeypatch)
    assert code == 2 and "Usage:" in stdout + stderr and "error" not in stderr.lower(), stderr


def test_an_unforeseen_error_is_one_line_and_exit_1(capsys, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr("probe.cli.classify.run_classify", broken)
    code, _, stderr = run_cli(["classify", "--model", PLANTED], capsys, monkeypatch)
    assert code == 1 and stderr.strip() == "error: RuntimeError: disk on fire (run with --debug for the traceback)"


def test_remote_code_runs_only_when_asked(capsys, monkeypatch) -> None:
    calls = []

    def record(spec, **kwargs):
        calls.append(kwargs)
        raise ProbeError("stop here")

    monkeypatch.setattr("probe.cli.options.load_model", record)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # org/name is not in the hub cache: no connection tried before loading
    for command in (["classify"], ["heatmap", "--text", "hi", "--html", "never.html"], ["ablate"]):
        assert run_cli([*command, "--model", "org/name"], capsys, monkeypatch)[0] == 2
        assert run_cli([*command, "--model", "org/name", "--trust-remote-code"], capsys, monkeypatch)[0] == 2
    assert [call.get("trust_remote_code", False) for call in calls] == [False, True] * 3
    help_text = run_cli(["classify", "--help"], capsys, monkeypatch)[1]
    assert "--trust-remote-code" in help_text and "runs that Python" in " ".join(help_text.split())


# ---------------------------------------------------------------------------------------------------------------
# -h, --version, flags without a placeholder


def test_h_is_help_everywhere(capsys, monkeypatch) -> None:
    for command in ([], ["classify"], ["ablate"], ["heatmap"], ["models"]):
        code, out, _ = run_cli([*command, "-h"], capsys, monkeypatch)
        assert code == 0 and "Usage:" in out and out == run_cli([*command, "--help"], capsys, monkeypatch)[1]


def test_version_comes_from_the_package_metadata(capsys, monkeypatch) -> None:
    assert run_cli(["--version"], capsys, monkeypatch)[:2] == (0, f"probe {metadata.version(DISTRIBUTION)}\n")

    def missing(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr("probe.provenance.metadata.version", missing)
    code, out, _ = run_cli(["--version"], capsys, monkeypatch)
    assert code == 0 and out.startswith("probe unknown (not installed")


def test_boolean_flags_show_no_value_placeholder(capsys, monkeypatch) -> None:
    help_lines = run_cli(["ablate", "--help"], capsys, monkeypatch)[1].splitlines()

    def line_of(flag: str) -> str:
        return next(line for line in help_lines if re.search(rf"{flag}\b", line))

    for flag in ("--together", "--naive", "--resume", "--force", "--trust-remote-code", "--help"):
        assert "<" not in line_of(flag), line_of(flag)
    assert "<int>" in line_of("--seq-len") and "<str>" in line_of("--heads")  # options with a value keep theirs
    assert "<bool>" not in run_cli(["--help"], capsys, monkeypatch)[1]


# ---------------------------------------------------------------------------------------------------------------
# the ablation report says what it measured


def report(payload: dict, top: int = 15) -> str:
    console = Console(record=True, width=200, file=io.StringIO())
    ablation_report(payload, console, top=top)
    return console.export_text()


def table_heads(text: str, title: str) -> list[str]:
    """The head labels of the rows of the table titled `title...` in a rendered report."""
    rows = text.split(title, 1)[1].split("\n\n", 1)[0].splitlines()[3:]
    return [row.split("│")[0].strip() for row in rows if "│" in row]


def test_the_baseline_line_does_not_carry_the_sweep_time() -> None:
    loaded = tiny_loaded("llama_gqa")
    payload = sweep(loaded, repeated_set(loaded, repeat_len=8, num_seqs=2)).to_dict()
    payload["seconds"] = 23.7
    text = report(payload)
    baseline = next(line for line in text.splitlines() if line.startswith("baseline loss:"))
    assert "23.7" not in baseline and not re.search(r"\d s\b", baseline)
    assert "time of the whole sweep (baseline and every ablation): 23.7 s" in text


def test_heads_that_hurt_are_only_those_with_a_positive_delta() -> None:
    loaded = tiny_loaded("llama_gqa")
    payload = sweep(loaded, repeated_set(loaded, repeat_len=8, num_seqs=2)).to_dict()
    for index, entry in enumerate(payload["heads"]):
        entry["delta"] = 0.5 - index * 0.1 if index < 2 else -0.01 * index  # two heads hurt, six help
    text = report(payload, top=5)
    assert table_heads(text, "Heads whose removal hurts most") == ["0.0", "0.1"]
    assert "(largest delta, 2 of 8)" in text
    assert table_heads(text, "Heads whose removal helps") == ["1.3", "1.2", "1.1", "1.0", "0.3"]
    for entry in payload["heads"]:
        entry["delta"] = -abs(entry["delta"]) - 0.01
    text = report(payload, top=5)
    assert "Heads whose removal hurts most" not in text and "No head raises the loss when removed." in text


def test_an_estimate_says_in_its_titles_that_it_is_one_and_how() -> None:
    loaded = tiny_loaded("llama_gqa")
    payload = estimate(loaded, repeated_set(loaded, repeat_len=8, num_seqs=2)).to_dict()
    text = report(payload, top=8)
    assert "largest estimated delta" in text or "most negative estimated delta" in text
    assert f"est. marks an estimated value, not an ablation ({payload['path']})" in " ".join(text.split("\n"))
    assert payload["path"].startswith("estimate: attribution patching")
    marks = {row.split("│")[-2].strip() for row in text.splitlines() if row.count("│") >= 5}
    assert marks <= {"exact", "est."} and "est." in marks
    assert "time of the whole estimate:" in text


# ---------------------------------------------------------------------------------------------------------------
# output that is not a terminal: no wrapping at 80 columns, plain progress lines; -q and -v


def test_a_report_in_a_file_is_not_wrapped_at_80_columns(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path))
    code, stdout, stderr = run_cli(["ablate", "--model", PLANTED, *SMALL], capsys, monkeypatch)  # stdout: no terminal
    assert code == 0, stderr
    lines_out = stdout.splitlines()
    assert f"Head ablation of {PLANTED} (2 layers x 4 heads, zero ablation)" in lines_out
    metric = next(line for line in lines_out if line.startswith("  metric:"))
    assert metric.endswith("(padding excluded)") and len(metric) > 80
    assert any(line.startswith("  computed: exact: ") and line.endswith("block") for line in lines_out)


PLAIN_LINE = re.compile(r"^ablating heads \d+%(, [\d.]+%/(min|s))?, \d+:\d\d elapsed(, ~\d+:\d\d left)?"
                        r"( \(\d+ heads? done\))?$")


def test_progress_in_a_log_file_is_plain_lines(tmp_path: Path, capsys, monkeypatch) -> None:
    log = tmp_path / "stderr.log"
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path))
    monkeypatch.setenv("PROBE_TEST_SLEEP", "0.05")
    with open(log, "w", encoding="utf-8") as stderr, contextlib.redirect_stderr(stderr):
        code, _, _ = run_cli(["ablate", "--model", SLOW, *SMALL, "--stack", "1"], capsys, monkeypatch)
    text = log.read_text(encoding="utf-8")
    assert code == 0, text
    assert "\r" not in text and "\x1b" not in text  # no live bar, no escape codes
    progress = [line for line in text.splitlines() if line.startswith("ablating heads")]
    assert all(PLAIN_LINE.match(line) for line in progress), progress
    assert 1 <= len(progress) <= 11  # one per tenth at most, none within a second of the last
    assert progress[-1].startswith("ablating heads 100%") and progress[-1].endswith(" (8 heads done)")  # all in


def test_quiet_shows_only_warnings_and_errors(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path))
    out = tmp_path / "sweep.json"
    code, stdout, stderr = run_cli(["-q", "ablate", "--model", PLANTED, *SMALL, "--json", str(out)], capsys,
                                   monkeypatch)
    assert code == 0 and stderr == "" and out.exists() and "Head ablation of" in stdout
    code, _, stderr = run_cli(["ablate", "--model", PLANTED, *SMALL, "--json", str(out), "--force"], capsys,
                              monkeypatch)
    assert code == 0 and f"wrote {out}" in stderr  # without -q: the notes
    code, _, stderr = run_cli(["--quiet", "classify", "--model", NAN, "--num-seqs", "2", "--json", str(out),
                               "--force"], capsys, monkeypatch)
    assert code == 0 and stderr.startswith("warning: numbers that are not finite") and "wrote" not in stderr
    code, _, stderr = run_cli(["-q", "ablate", "--model", PLANTED, "--top", "0"], capsys, monkeypatch)
    assert code == 2 and stderr.strip() == "error: --top must be at least 1, got 0"


def test_verbose_shows_the_library_log(capsys, monkeypatch) -> None:
    def logs(*args, **kwargs):
        logging.getLogger("probe.classify").info("scored every head")
        raise ProbeError("stop here")

    monkeypatch.setattr("probe.cli.classify.run_classify", logs)
    code, _, stderr = run_cli(["-v", "classify", "--model", PLANTED], capsys, monkeypatch)
    assert code == 2 and "probe.classify: scored every head" in stderr
    code, _, stderr = run_cli(["classify", "--model", PLANTED], capsys, monkeypatch)
    assert code == 2 and "scored every head" not in stderr



@pytest.mark.parametrize("flags", [["-q"], ["--quiet"], ["--debug", "-q"]])
def test_global_flags_work_after_the_command(flags: list[str], tmp_path: Path, capsys, monkeypatch) -> None:
    """`probe ablate ... -q` (where a newcomer types it) is `probe -q ablate ...`: notes go, the result stays."""
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path))
    out = tmp_path / "sweep.json"
    code, stdout, stderr = run_cli(["ablate", "--model", PLANTED, *SMALL, "--json", str(out), *flags], capsys,
                                   monkeypatch)
    assert code == 0 and stderr == "" and out.exists() and "Head ablation of" in stdout


def test_verbose_and_debug_after_the_command(capsys, monkeypatch) -> None:
    def logs(*args, **kwargs):
        logging.getLogger("probe.classify").info("scored every head")
        raise RuntimeError("disk on fire")

    monkeypatch.setattr("probe.cli.classify.run_classify", logs)
    code, _, stderr = run_cli(["classify", "--model", PLANTED, "-v"], capsys, monkeypatch)
    assert code == 1 and "probe.classify: scored every head" in stderr and "Traceback" not in stderr
    with pytest.raises(RuntimeError, match="disk on fire"):  # --debug: the traceback, also after the command
        run_cli(["classify", "--model", PLANTED, "--debug"], capsys, monkeypatch)
    code, _, stderr = run_cli(["-q", "classify", "--model", PLANTED, "-v"], capsys, monkeypatch)
    assert code == 2 and stderr.strip() == "error: -q and -v contradict each other: give one"
    code, _, stderr = run_cli(["classify", "--model", PLANTED], capsys, monkeypatch)  # nothing left over
    assert code == 1 and "scored every head" not in stderr

# ---------------------------------------------------------------------------------------------------------------
# a head has one short and one long name


def test_a_head_has_one_short_and_one_long_name(capsys, monkeypatch) -> None:
    assert (short_label(18, 6), long_label(18, 6)) == ("18.6", "layer 18, head 6")
    heads = [{"layer": layer, "head": head, "loss": 2.0, "delta": 0.1 * (layer + head)} for layer in range(2)
             for head in range(3)]
    page = ablation_page({"model": "m", "method": "zero", "baseline_loss": 1.0, "heads": heads})
    top = json.loads(re.search(r'id="[^"]+-data">(.*?)</script>', page, re.S).group(1))["top"]
    assert top["label"][0] == "1.2" and top["name"][0] == "layer 1, head 2"  # axis: short; hover: long
    assert "%{text}: " in (ROOT / "reports" / "assets" / "probe.js").read_text(encoding="utf-8")
    payload = {"model": "m", "method": "zero", "mode": "exact", "data": "d", "metric": "ce", "path": "p",
               "n_layers": 2, "n_heads": 3, "baseline_loss": 1.0, "heads": heads}
    assert table_heads(report(payload), "hurts most")[0] == "1.2"
    sources = [*(ROOT / "cli").glob("*.py"), *(ROOT / "reports").glob("*.py"), ROOT / "reports" / "assets" / "probe.js"]
    sources.remove(ROOT / "reports" / "labels.py")  # the one place names are made: its column form is `L18H6`
    assert column_label(18, 6) == "L18H6" and column_label(3, 1, ["enc0"] * 3 + ["x3"]) == "x3.1"
    other_forms = re.compile(r"""["'(]L["'{+]|\bL\{|H\{|["'] ?H["']|Layer \{|head \{[^}]*\}, layer""")
    assert [path.name for path in sources if other_forms.search(path.read_text(encoding="utf-8"))] == []


def test_help_at_80_columns_cuts_no_option_name(capsys, monkeypatch) -> None:
    """A terminal of 80 columns shows every option's whole name: rich shortens a name column ('--trust-remote-co…')
    when the columns beside it cannot give way."""
    from probe.cli.reference import command_names

    monkeypatch.setenv("COLUMNS", "80")
    for name in command_names():
        code, stdout, _ = run_cli([name, "--help"], capsys, monkeypatch)
        assert code == 0, name
        cut = [line for line in stdout.splitlines() if re.match(r"│ *-", line) and "…" in line]
        assert cut == [], (name, cut)


def test_help_shows_every_option_text_whole(capsys, monkeypatch) -> None:
    """typer's rich help reads markup in help texts: `razor:FILE.json ({layer: [kv_head, ...]} kept full)` lost its
    brackets' contents as an unknown tag. Every option's text is shown as written."""
    import typer

    from probe.cli.app import app
    from probe.cli.reference import command_names

    monkeypatch.setenv("COLUMNS", "400")
    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    for name in command_names():
        code, stdout, _ = run_cli([name, "--help"], capsys, monkeypatch)
        shown = " ".join(stdout.replace("│", " ").split())
        for param in commands[name].params:
            if getattr(param, "help", None):
                written = " ".join(param.help.replace("\\[", "[").split())  # as written, rich's escapes undone
                assert written in shown, (name, param.name, written)

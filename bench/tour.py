"""`python -m bench.tour`: the README's CLI tour and its Python block run as written, each in a fresh process in one
temporary folder (the tour's inputs made there first, as tests/test_readme_tour.py makes them), with the wall time
of each against the time the README states beside it, its CPU time, and the longest silent gap between two lines of
its stderr (the start and the end count as lines; a line ends at a newline or a carriage return, so a bar redrawn
in place counts each time). It reads no line's content: only when each line came.

Each command has a timeout (`--timeout`, 600 s by default: past it the command is stopped and marked so) and each
result is saved as it comes (bench/results/tour.json, RESULTS.md re-rendered), so an unattended run always finishes
and leaves what it measured. `--quick` appends the flags that shrink each command's inputs (SMALL, the tour test's)
and runs a shrunken Python block: a check that the harness and the tour work, not a timing. `--only NAME` runs the
commands of those subcommands (`python` for the Python block), keeping the other rows of the last run. Times depend
on the machine and its load: the README's are for 2 quiet cores; run this on such a machine for the table that counts.

`--doc docs/getting-started.md` runs a document's `probe` lines (every line of its bash blocks that starts with
`probe `) the same way, into a result of its own (bench/results/tour-getting-started.json, its own RESULTS.md
section): the lines that cannot run as written here, offline, are listed as skipped with the reason (a model or a
file the user brings, a model only the hub has, a package not installed); files of the clone a line names
(`tests/planted.py`) are copied into the folder, as if run from a clone. `--except-readme` leaves out the lines the
README's tour has too (its run times them).

`--busy N` runs the same steps beside N busy processes (`python3 -c 'while True: pass'`, started before the first
step and stopped after the last), into a result of its own (`tour-busy`); RESULTS.md shows its seconds and longest
silence beside the quiet run's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import report
from bench.common import ROOT, TOUR_DOCS, load_result, machine, now, save_result, tour_result

README = ROOT / "README.md"
INPUT_FLAGS = ("--data", "--file", "--conllu", "--labels")  # flags whose path-like value is a file the command reads
TIMEOUT = 600.0  # seconds a command may run before it is stopped (the README aims each under 3 minutes)
SMALL = {  # flags that shrink a command's inputs (appended: the last occurrence of a flag wins)
    "classify": ["--num-seqs", "1", "--seq-len", "16", "--repeat-len", "8"],
    "ablate": ["--num-seqs", "1", "--seq-len", "8", "--heads", "0-1.*,17.3"],
    "syntax": ["--max-sentences", "4", "--min-count", "1"],
    "circuits": ["--num-seqs", "1", "--seq-len", "24", "--repeat-len", "12"],
    "prune": ["--num-seqs", "1", "--seq-len", "8", "--seeds", "1", "--step", "0.25"],
    "dla": ["--count", "2"],
    "qk": ["--num-seqs", "1", "--repeat-len", "12"],
    "patch": ["--count", "2", "--heads", "0-1.*,17.3"],
    "steer": ["--num-seqs", "2", "--max-new-tokens", "4"],
    "kv-heads": ["--lengths", "160", "--depths", "0.5", "--sink", "4", "--recent", "32", "--steps", "2",
                 "--random-seeds", "0", "--curve-texts", "1"],
    "atlas": ["--num-seqs", "1", "--seq-len", "16", "--repeat-len", "8"],
    "serve": ["--help"],  # serves until stopped: the quick tour checks that its line parses
    "track": ["--num-seqs", "1", "--seq-len", "24", "--repeat-len", "12", "--icl-seqs", "2", "--icl-positions",
              "2,20"],
}
QUICK_PYTHON = (  # the Python block's calls with small inputs (--quick): (a call's start, the arguments it gets)
    ("classify(loaded", ", num_seqs=1, seq_len=16, repeat_len=8"),
    ("natural_set(loaded", ", seq_len=8, num_seqs=1"),
    ("atlas(loaded", ", num_seqs=1, seq_len=16, repeat_len=8"),
)
RUN_PY = f"""
import sys
import torch
sys.path.insert(0, {str(ROOT / 'examples' / 'induction')!r})
from model import AttentionOnly, ByteTokenizer


def model():
    return AttentionOnly(n_layers=2, d_model=32, n_heads=4, max_len=256), ByteTokenizer()
"""
STATED = re.compile(r"\bunder (\d+(?:\.\d+)?) (s|min)\b")
READY = {"serve": re.compile(r"^serving .*: open http")}  # a command that runs until stopped: timed to this line


@dataclass(frozen=True)
class Step:
    """One thing the tour runs: a command line (`probe ...`) or the Python block, with the time the README states."""

    name: str
    line: str
    stated: float | None  # seconds, from "(under N min)" beside it

    def argv(self, python: str, quick: bool) -> list[str]:
        if self.name == "python":
            return [python, "-c", quick_python(self.line) if quick else self.line]
        args = shlex.split(self.line)[1:]
        small = SMALL.get(args[0], []) if quick and not {"--model", "-m"} & set(args) else []
        return [python, "-c", "import sys; from probe.cli.app import main; sys.argv[0] = 'probe'; sys.exit(main())",
                *args, *small]


def quick_python(code: str) -> str:
    """The Python block with QUICK_PYTHON's small inputs: each call's own keywords (written as `name=value`) kept
    where QUICK_PYTHON does not give the same one, the rest of the block as written."""
    for call, small in QUICK_PYTHON:
        given = dict(item.split("=", 1) for item in small.lstrip(", ").split(", "))

        def shrink(found: re.Match[str], given: dict[str, str] = given, call: str = call) -> str:
            own = [item for item in found[1].lstrip(", ").split(", ") if item and item.split("=")[0] not in given]
            return call + "".join(f", {item}" for item in own) + small

        code = re.sub(re.escape(call) + r"((?:, [a-z_]+=[^,()]+)*)(?=\))", shrink, code)
    return code


def _seconds(text: str) -> float | None:
    found = STATED.search(text)
    return None if found is None else float(found[1]) * (60 if found[2] == "min" else 1)


def tour_lines(readme: str) -> list[tuple[str, str]]:
    """(command, its comment) of each line of the README's `## CLI tour` bash block."""
    block = re.search(r"## CLI tour\s+```bash\n(.*?)```", readme, re.S)
    if block is None:
        raise SystemExit("README.md has no CLI tour block")
    pairs = [(line.split("  #")[0].strip(), line.partition("  #")[2]) for line in block.group(1).splitlines()]
    return [(command, comment) for command, comment in pairs if command]


def python_block(readme: str) -> str:
    """The README's Python block (the one under `## Python API`)."""
    block = re.search(r"## Python API\s+```python\n(.*?)```", readme, re.S)
    if block is None:
        raise SystemExit("README.md has no Python API block")
    return block.group(1)


def steps(readme: str) -> list[Step]:
    """Every tour command, then the Python block (its stated time: the `(under N min)` of its first lines)."""
    found = [Step(shlex.split(command)[1], command, _seconds(comment)) for command, comment in tour_lines(readme)]
    code = python_block(readme)
    return [*found, Step("python", code, _seconds("\n".join(code.splitlines()[:2])))]


def doc_steps(text: str) -> list[Step]:
    """Every `probe ...` line of a document's bash blocks, in order, with the time stated in its comment."""
    steps_: list[Step] = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            command, _, comment = line.partition("  #")
            if command.startswith("probe "):
                steps_.append(Step(shlex.split(command)[1], command.strip(), _seconds(comment)))
    return steps_


def skip_reason(line: str, folder: Path) -> str | None:
    """Why a command cannot run as written in `folder`, offline (None: it can): a model or file the user brings, a
    model only the hub has, or a package this environment lacks."""
    args = shlex.split(line)[1:]
    values = dict(zip(args, args[1:]))
    model = values.get("--model") or values.get("-m")
    if model is not None and (missing := _model_missing(model, folder)):
        return missing
    for flag in INPUT_FLAGS:
        value = values.get(flag)
        if value is not None and ("." in value or "/" in value) and not (folder / value).exists():
            return f"needs a file of yours: {flag} {value}"
    if args[0] == "syntax" and "--conllu" not in args and not _have_spacy():
        return "needs spaCy and an English pipeline (pip install 'probe-heads[syntax]'), or --conllu FILE"
    return None


def _model_missing(spec: str, folder: Path) -> str | None:
    """Why `--model spec` cannot load here offline, or None."""
    from probe.models import ALIASES, HUB_ALIASES, alias_path, hub_cached
    from probe.models.custom import is_custom_spec

    if spec in ALIASES:
        return None if alias_path(ALIASES[spec]) else f"needs the model's wheel: {ALIASES[spec].install}"
    if spec in HUB_ALIASES:
        return None if hub_cached(HUB_ALIASES[spec]) else f"needs the hub: {spec} is not in the hub cache"
    path = spec.rpartition(":")[0] if is_custom_spec(spec) else spec
    if (folder / path).exists():
        return None
    if spec.count("/") == 1 and not path.endswith((".py", ".gguf")):
        return f"needs the hub: {spec} is a hub id"
    return f"needs a model of yours: {spec}"


def _have_spacy() -> bool:
    from probe.syntax.parse import PIPELINES

    return importlib.util.find_spec("spacy") is not None and any(
        importlib.util.find_spec(name) is not None for name in PIPELINES)


def copy_clone_files(folder: Path, chosen: Iterable[Step]) -> None:
    """The clone's files the commands name (a `--model FILE.py:FUNCTION` such as tests/planted.py, an input file),
    copied into `folder` at the same relative path: the document's commands run from a clone."""
    from probe.models.custom import is_custom_spec

    for step in chosen:
        args = [] if step.name == "python" else shlex.split(step.line)[1:]
        for flag, value in zip(args, args[1:]):
            if flag not in (*INPUT_FLAGS, "--model", "-m"):
                continue
            path = value.rpartition(":")[0] if is_custom_spec(value) else value
            source = ROOT / path
            if source.is_file() and not (folder / path).exists():
                (folder / path).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, folder / path)


def make_inputs(folder: Path) -> None:
    """What the tour's commands name: `my-classifier` and `dev.jsonl`, `run.py` and `ckpt/step-*.pt`."""
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from classifiers import tiny_bert_classifier, word_tokenizer

    words = ["the", "film", "was", "good", "bad", "fine", "plot", "acting",
             "quick", "brown", "fox", "jumps"]  # the loader's check encodes a fox
    tokenizer = word_tokenizer(words)
    tiny_bert_classifier(len(tokenizer)).save_pretrained(folder / "my-classifier")
    tokenizer.save_pretrained(folder / "my-classifier")
    rows = [{"text": f"the {noun} was {word}", "label": label} for noun in ("film", "plot", "acting")
            for word, label in (("good", "positive"), ("bad", "negative"), ("fine", "neutral"))]
    (folder / "dev.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    (folder / "run.py").write_text(RUN_PY, encoding="utf-8")
    (folder / "ckpt").mkdir(exist_ok=True)
    namespace: dict[str, Any] = {}
    exec(compile(RUN_PY, "run.py", "exec"), namespace)
    for step in (10, 20):
        torch.manual_seed(step)
        torch.save(namespace["model"]()[0].state_dict(), folder / "ckpt" / f"step-{step}.pt")


@dataclass
class Outcome:
    """What one step did: its exit, its wall time and CPU time, its longest silent gap, its last lines."""

    name: str
    line: str
    stated: float | None
    code: int | None = None
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # user + system, the step's processes together
    timed_out: bool = False
    ready: bool | None = None  # a READY command: whether its line came (then stopped with Ctrl-C, timed to it)
    gap: float = 0.0
    tail: list[str] = field(default_factory=list)


def longest_silence(times: Iterable[float], ended: float) -> float:
    """The longest gap between two lines of a step's stderr, from the seconds since the start each line came and
    the step's end (the start and the end count as lines)."""
    marks = [0.0, *times, ended]
    return max(later - earlier for earlier, later in zip(marks, marks[1:]))


def run_step(step: Step, folder: Path, timeout: float, quick: bool = False,
             python: str = sys.executable) -> Outcome:
    """One step in its own process (its own process group, stopped whole at the timeout), stderr read line by line
    as it comes, each line timed. A READY step (a server) reads stdout too, is timed to its ready line and then
    gets a Ctrl-C; its browser is `true` (`--open` opens nothing)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(
        os.pathsep), "PYTHONUNBUFFERED": "1", "BROWSER": "true"}
    env.pop("COLUMNS", None)
    ready = READY.get(step.name) if not quick else None
    used = _children_cpu()
    started = time.monotonic()
    child = subprocess.Popen(step.argv(python, quick), cwd=folder, env=env, start_new_session=True,
                             stdout=subprocess.DEVNULL if ready is None else subprocess.PIPE,
                             stderr=subprocess.PIPE if ready is None else subprocess.STDOUT)
    stream = child.stderr if ready is None else child.stdout
    lines: list[tuple[float, str]] = []
    assert stream is not None
    reader = threading.Thread(target=_read, args=(stream, lines, started), daemon=True)
    reader.start()
    outcome = Outcome(step.name, step.line, step.stated)
    ready_at = None
    try:
        if ready is None:
            outcome.code = child.wait(timeout=timeout)
        else:
            outcome.code, ready_at = _until_ready(child, ready, lines, timeout)
            outcome.ready = ready_at is not None
    except subprocess.TimeoutExpired:
        outcome.timed_out = True
    finally:  # past the timeout, and where the harness itself is stopped: the step's processes go too
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    ended = time.monotonic() - started if ready_at is None else ready_at
    reader.join(timeout=10)
    outcome.seconds = round(ended, 1)
    outcome.cpu_seconds = round(_children_cpu() - used, 1)
    outcome.gap = round(longest_silence((at for at, _ in lines if at <= ended), ended), 1)
    outcome.tail = [text for _, text in lines[-8:]]
    return outcome


def _until_ready(child: subprocess.Popen[bytes], ready: re.Pattern[str], lines: list[tuple[float, str]],
                 timeout: float) -> tuple[int, float | None]:
    """Wait for a server's ready line (or its exit), then stop it as Ctrl-C does: its exit code, and the seconds
    at which the line came (None where it exited first)."""
    deadline = time.monotonic() + timeout
    ready_at = None
    while child.poll() is None and ready_at is None:
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(child.args, timeout)
        time.sleep(0.2)
        ready_at = next((at for at, text in list(lines) if ready.search(text)), None)
    if ready_at is not None and child.poll() is None:
        os.killpg(child.pid, signal.SIGINT)
    return child.wait(timeout=30), ready_at


def _children_cpu() -> float:
    """CPU seconds (user + system) of this process's children that have ended: a step's own work, which other work
    on the host inflates less than its wall time (a CPU-bound step's quiet wall time is at most its CPU time)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _read(stream: Any, lines: list[tuple[float, str]], started: float) -> None:
    """Each line of the binary `stream` as it comes, with its time: a line ends at a newline or a carriage return
    (read as soon as it arrives, not held back to see whether a newline follows it)."""
    pending = b""
    while chunk := stream.read1(65536):
        *complete, pending = re.split(rb"\r\n?|\n", pending + chunk)
        at = time.monotonic() - started
        lines += [(at, text.decode(errors="replace")) for text in complete if text]
    if pending:
        lines.append((time.monotonic() - started, pending.decode(errors="replace")))


def busy_processes(count: int) -> list[subprocess.Popen[bytes]]:
    """`count` processes that each keep one core busy, as other programs on a laptop do: each in a session of its
    own, so that the kernel's autogroups share the CPUs between them and the step as between separate programs
    (in the harness's one session, they would share one CPU between them)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            for _ in range(count)]


def run(only: list[str] | None = None, timeout: float = TIMEOUT, quick: bool = False,
        log: Callable[[str], None] = print, save: Callable[[dict[str, Any]], None] | None = None,
        text: str | None = None, doc: str | None = None, except_readme: bool = False,
        busy: int = 0) -> dict[str, Any]:
    """Every step (or those of `only`) in one fresh temporary folder, in the document's order: the README's tour
    and Python block, or with `doc` that document's `probe` lines (`text`: its text, else read from the clone);
    the steps that cannot run here are listed as skipped with the reason, and with `except_readme` those the
    README's tour has too; with `busy`, beside that many busy processes. `save` gets the result so far after each
    step."""
    text = text if text is not None else (ROOT / (doc or "README.md")).read_text(encoding="utf-8")
    every = steps(text) if doc is None else doc_steps(text)
    data: dict[str, Any] = {"date": now(), "machine": machine(packages=("transformers",)), "quick": quick,
                            "timeout": timeout, "load_before": os.getloadavg(), "doc": doc, "busy": busy, "rows": []}
    spinners = busy_processes(busy)
    try:
        _run_steps(every, data, only, timeout, quick, log, save, except_readme)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    return data


def _run_steps(every: list[Step], data: dict[str, Any], only: list[str] | None, timeout: float, quick: bool,
               log: Callable[[str], None], save: Callable[[dict[str, Any]], None] | None,
               except_readme: bool) -> None:
    """Each step not skipped, in one fresh temporary folder, its row appended to `data` as it ends."""
    with tempfile.TemporaryDirectory(prefix="probe-tour-") as folder:
        make_inputs(Path(folder))
        copy_clone_files(Path(folder), every)
        toured = {line for line, _ in tour_lines(README.read_text(encoding="utf-8"))} if except_readme else set()
        data["skipped"] = [{"name": step.name, "line": step.line, "stated": step.stated, "reason": reason}
                           for step in every if (reason := _skipped(step, Path(folder), toured))]
        skipped = {entry["line"] for entry in data["skipped"]}
        for step in every:
            if step.line in skipped or (only and step.name not in only and step.line not in only):
                continue
            log(f"-- {step.line.splitlines()[0] if step.name != 'python' else 'the README Python block'}")
            outcome = run_step(step, Path(folder), timeout, quick)
            row = asdict(outcome) | {"load": os.getloadavg()}
            data["rows"].append(row)
            log(f"   {_verdict(row)}")
            if save is not None:
                save(data)


def _skipped(step: Step, folder: Path, toured: set[str]) -> str | None:
    """Why `step` is not run (skip_reason; a line of `toured`, the README's tour), or None."""
    if step.name == "python":
        return None
    if step.line in toured:
        return "the README tour's line: timed in its table"
    return skip_reason(step.line, folder)


def _verdict(row: dict[str, Any]) -> str:
    if row["timed_out"]:
        return f"stopped at the timeout ({row['seconds']:.0f} s)"
    exit_text = "ok" if row["code"] == 0 else f"exit {row['code']}: {' | '.join(row['tail'][-2:])}"
    return (f"{exit_text}, {row['seconds']:.0f} s ({row['cpu_seconds']:.0f} s of CPU), longest silence "
            f"{row['gap']:.0f} s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.tour", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", default=None, metavar="NAME",
                        help="run only this subcommand's tour lines, or this one line as written (repeatable; "
                             "`python`: the Python block)")
    parser.add_argument("--timeout", type=float, default=TIMEOUT, help="seconds a step may run (default 600)")
    parser.add_argument("--quick", action="store_true", help="small inputs: check the harness, not a timing "
                                                             "(saved as tour-quick.json, left out of RESULTS.md)")
    parser.add_argument("--doc", metavar="PATH", help="run this document's `probe` lines instead of the README's "
                                                      f"tour (a path in the clone: {', '.join(TOUR_DOCS)})")
    parser.add_argument("--except-readme", action="store_true",
                        help="with --doc: leave out the lines the README's tour has too (its run times them)")
    parser.add_argument("--busy", type=int, default=0, metavar="N",
                        help="run beside N busy processes (saved as tour-busy.json, shown beside the quiet run)")
    args = parser.parse_args(argv)
    if args.doc is not None and not (ROOT / args.doc).is_file():
        parser.error(f"--doc {args.doc}: no such file in {ROOT}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `kill`: the running step is stopped with the harness

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    name = tour_result(args.doc) + ("-busy" if args.busy else "") + ("-quick" if args.quick else "")
    previous = load_result(name) if args.only else None

    def save(data: dict[str, Any]) -> None:
        if previous is not None:  # a run of some steps: the other steps' rows kept, in the document's order
            rows = {row["line"]: row for row in previous["rows"]} | {row["line"]: row for row in data["rows"]}
            text = (ROOT / (args.doc or "README.md")).read_text(encoding="utf-8")
            order = [step.line for step in (steps(text) if args.doc is None else doc_steps(text))]
            data = data | {"rows": [rows[line] for line in order if line in rows]}
        save_result(name, data)
        if not args.quick:
            report.write()

    data = run(args.only, args.timeout, args.quick, log, save, doc=args.doc, except_readme=args.except_readme,
               busy=args.busy)
    save(data)
    log(report.tour(data))


if __name__ == "__main__":
    main()

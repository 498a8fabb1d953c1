"""Issue 33's soak: many short sweeps (`probe ablate`) and patching runs (`probe patch`) on tiny models, each killed
at a random moment (SIGINT or SIGKILL) and resumed with `--resume` (each run a child of a multiprocessing fork server,
tests/soak_child.py, never a fork of this process; the uninterrupted references `python -m probe.cli` processes).
After every kill the results stream reads as a subset of an uninterrupted run's (or is refused in one line, never
silently wrong); after every resume it holds every ablation, each equal to the uninterrupted run's; at the end the
model folder's bytes are unchanged.

CI runs 10 rounds (`--soak-rounds`, tests/conftest.py; 0.5 to 0.8 s a round after ~11 s of references and the
server's start); `pytest --soak-rounds=200 tests/test_soak.py` is the issue's count."""

from __future__ import annotations

import hashlib
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import tiny_hf
from soak_child import Child
from probe.ablation.stream import read_results
from probe.errors import ProbeError

ROOT = Path(__file__).parent.parent
EXPECTED = {"ablate": 8, "patch": 8}
"""Ablations each run streams: the tiny llama's 2 x 4 heads, one at a time."""
WORDS = f"{Path(__file__).parent / 'soak_models.py'}:tiny_llama_words"
PAIRS = [("go home now here", "run school fast there", " today", " work"),
         ("run school fast there", "walk work today slowly", " here", " home"),
         ("walk work today slowly", "sing home here now", " there", " school"),
         ("sing home here now", "go school there fast", " slowly", " work")]


def commands(folder: Path, pairs: Path) -> dict[str, list[str]]:
    return {"ablate": ["-q", "ablate", "--model", str(folder), "--data", "repeated", "--num-seqs", "4", "--repeat-len",
                       "32", "--stack", "1"],
            "patch": ["-q", "patch", "--model", WORDS, "--pairs", str(pairs), "--no-classes", "--stack", "1"]}


def start(args: list[str], tmp_path: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PROBE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "probe.cli", *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def finish(args: list[str], tmp_path: Path) -> tuple[int, str]:
    process = Child(args, tmp_path)
    _, err = process.communicate(timeout=600)
    assert process.returncode is not None
    return process.returncode, err


def when_written(process: subprocess.Popen | Child, stream: Path, lines: int = 1) -> float:
    """Wait until the run's stream holds `lines` lines (1: the header, the sweep has begun); the time then."""
    while process.poll() is None and not (stream.is_file() and stream.read_bytes().count(b"\n") >= lines):
        time.sleep(0.005)
    return time.monotonic()


def entries(path: Path) -> dict:
    return {entry.heads: entry for entry in read_results(path)[1]}


def same(entry, expected) -> bool:
    return all(math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-7) or (math.isnan(a) and math.isnan(b))
               for a, b in ((entry.loss, expected.loss), (entry.delta, expected.delta)))


def folder_hash(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def check_after_kill(stream: Path, reference: dict, seen: dict) -> bool:
    """The stream a kill left: a subset of the reference, every number equal, or refused in one line. True: it
    reads (resume continues it)."""
    if not stream.is_file() or stream.stat().st_size == 0:
        seen["empty"] += 1
        return True
    try:
        found = entries(stream)
    except ProbeError as error:
        assert "\n" not in str(error)
        seen["refused"] += 1
        return False
    assert set(found) <= set(reference) and all(same(found[key], reference[key]) for key in found)
    seen["partial" if 0 < len(found) < len(reference) else "whole" if found else "header only"] += 1
    return True


def one_round(rng: random.Random, args: list[str], reference: dict, took: float, tmp_path: Path,
              seen: dict) -> None:
    stream = tmp_path / "round.jsonl"
    stream.unlink(missing_ok=True)
    process = Child([*args, "--results", str(stream)], tmp_path)
    when_written(process, stream)
    time.sleep(rng.uniform(0, 1.2 * took))  # somewhere in the sweep, or just after it
    kind = rng.choice([signal.SIGINT, signal.SIGKILL])
    process.send_signal(kind)
    _, err = process.communicate(timeout=600)
    assert process.returncode in (0, 130, -signal.SIGINT, -signal.SIGKILL), err
    if process.returncode == 130:
        last = err.strip().splitlines()[-1]  # one line: what was saved, and how to go on
        assert "Traceback" not in err and (last == "interrupted" or last.startswith("interrupted; ")), err
    seen[kind.name] += 1
    readable = check_after_kill(stream, reference, seen)
    code, err = finish([*args, "--results", str(stream), "--resume", "--force"], tmp_path)
    if not readable:  # refused: one line, exit 2; then start over
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        code, err = finish([*args, "--results", str(stream), "--force"], tmp_path)
    assert code == 0, err
    resumed = entries(stream)
    assert set(resumed) == set(reference) and all(same(resumed[key], reference[key]) for key in reference)


@pytest.mark.slow
def test_interrupted_runs_resume_to_the_uninterrupted_result(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if request.config.getoption("--soak-rounds") < 1:
        pytest.skip("--soak-rounds 0")
    folder = tmp_path / "model"
    tiny_hf("llama_gqa").save_pretrained(folder)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(f'{{"clean": "{a}", "corrupt": "{b}", "answer": "{c}", "distractor": "{d}"}}\n'
                             for a, b, c, d in PAIRS), encoding="utf-8")
    before = folder_hash(folder)
    references, times = {}, {}
    for name, args in commands(folder, pairs).items():  # uninterrupted, `python -m probe.cli`, timed from the header
        stream = tmp_path / f"{name}.jsonl"
        process = start([*args, "--results", str(stream)], tmp_path)
        began = when_written(process, stream)
        ended = when_written(process, stream, EXPECTED[name] + 1)  # the header and every ablation
        _, err = process.communicate(timeout=600)
        assert process.returncode == 0, err
        times[name], references[name] = ended - began, entries(stream)
        assert len(references[name]) == EXPECTED[name]
    rounds, rng = request.config.getoption("--soak-rounds"), random.Random(33)
    seen = {key: 0 for key in ("SIGINT", "SIGKILL", "empty", "refused", "partial", "whole", "header only")}
    began = time.monotonic()
    for index in range(rounds):
        name = ("ablate", "patch")[index % 2]
        one_round(rng, commands(folder, pairs)[name], references[name], times[name], tmp_path, seen)
        print(f"soak round {index + 1}/{rounds} ({time.monotonic() - began:.1f} s): {seen}", flush=True)
    print(f"soak: {rounds} interrupted and resumed runs in {time.monotonic() - began:.1f} s, {seen}")
    assert folder_hash(folder) == before

"""The threads torch computes on: the CPUs free when the run starts (the affinity less the CPUs busy now, sampled from
/proc/stat, else the load average), unless --threads or PROBE_THREADS gives a count; the report's last line says how
many."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from probe import threads
from probe.reports import labels
from probe.threads import free_cpus, use_threads

PLANTED = f"{Path(__file__).parent / 'planted.py'}:planted_textbook"


@pytest.fixture(autouse=True)
def keep_torch_threads(monkeypatch) -> Iterator[None]:
    """Each test starts with no count chosen and leaves torch's own as it found it."""
    before, said = torch.get_num_threads(), dict(labels._run)
    monkeypatch.delenv(threads.ENV, raising=False)
    yield
    torch.set_num_threads(before)
    labels._run.clear()
    labels._run.update(said)


def machine(monkeypatch, cpus: int, load: float, sampled: float | None = None) -> None:
    """A machine whose process may run on `cpus` CPUs, under a 1-minute load of `load`, with `sampled` CPUs busy
    now (None: no /proc/stat)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(threads, "sampled_busy", lambda cpus: sampled)


@pytest.mark.parametrize("cpus, load, free", [(8, 0.0, 8), (8, 2.6, 5), (8, 7.6, 1), (2, 7.0, 1), (4, -1.0, 4)])
def test_the_free_cpus_are_the_affinity_less_the_load(cpus: int, load: float, free: int, monkeypatch) -> None:
    machine(monkeypatch, cpus, load)
    assert free_cpus() == free
    assert use_threads() == free and torch.get_num_threads() == free


def test_the_cpus_busy_now_count_not_the_load_average_of_the_last_minute(monkeypatch) -> None:
    machine(monkeypatch, 2, 1.9, sampled=0.1)  # the last command's load still in the average: both CPUs are free
    assert free_cpus() == 2
    machine(monkeypatch, 8, 0.0, sampled=5.7)  # six processes started a second ago
    assert free_cpus() == 2


STAT = """cpu  300 0 100 900 0 0 0 0 0 0
cpu0 100 0 50 400 0 0 0 0 0 0
cpu1 200 0 50 500 0 0 0 0 0 0
intr 12345
"""


def test_ticks_are_read_per_cpu_of_the_affinity(tmp_path, monkeypatch) -> None:
    assert threads.cpu_ticks(STAT, {0, 1}) == {0: (400, 550), 1: (500, 750)}
    assert threads.cpu_ticks(STAT, {1}) == {1: (500, 750)}
    later = STAT.replace("cpu0 100 0 50 400", "cpu0 125 0 50 400").replace("cpu1 200 0 50 500", "cpu1 200 0 50 525")
    texts = iter([STAT, later])
    monkeypatch.setattr(threads, "PROC_STAT", type("Stat", (), {"read_text": lambda self: next(texts)})())
    assert threads.sampled_busy({0, 1}, seconds=0.0) == pytest.approx(1.0, abs=0.05)  # cpu0 all busy, cpu1 idle


@pytest.mark.skipif(not threads.PROC_STAT.exists(), reason="no /proc/stat on this platform")
def test_a_process_busy_now_is_seen_at_once() -> None:
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert threads.sampled_busy(set(range(os.cpu_count() or 1)), seconds=0.5) >= 0.6
    finally:
        spinner.kill()
        spinner.wait()


def test_no_load_average_leaves_the_affinity(monkeypatch) -> None:
    machine(monkeypatch, 3, 0.0)

    def unavailable() -> tuple[float, float, float]:
        raise OSError("no load average")

    monkeypatch.setattr(os, "getloadavg", unavailable)
    assert free_cpus() == 3


def test_a_count_given_or_the_environment_overrides_the_free_cpus(monkeypatch) -> None:
    machine(monkeypatch, 8, 6.0)
    monkeypatch.setenv(threads.ENV, "3")
    assert use_threads() == 3 and torch.get_num_threads() == 3
    assert use_threads(2) == 2 and torch.get_num_threads() == 2  # --threads wins over the environment


@pytest.mark.parametrize("args, env, said", [([], None, "on 1 thread"), (["--threads", "2"], None, "on 2 threads"),
                                             ([], "3", "on 3 threads"), (["--threads", "2"], "3", "on 2 threads")])
def test_the_report_says_the_threads_the_option_or_environment_chose(args: list[str], env: str | None, said: str,
                                                                     capsys, monkeypatch) -> None:
    machine(monkeypatch, 4, 3.2)
    if env is not None:
        monkeypatch.setenv(threads.ENV, env)
    code, out, err = run_cli(["classify", "--model", PLANTED, "--seq-len", "16", "--num-seqs", "2", *args], capsys,
                             monkeypatch)
    assert code == 0, err
    assert f"Computed in float32, {said}." in out
    assert torch.get_num_threads() == int(said.split()[1])


def test_threads_after_the_command_replace_those_before_it(capsys, monkeypatch) -> None:
    code, out, err = run_cli(["--threads", "3", "classify", "--model", PLANTED, "--seq-len", "16", "--num-seqs", "2",
                              "--threads", "1"], capsys, monkeypatch)
    assert code == 0, err
    assert "Computed in float32, on 1 thread." in out


@pytest.mark.parametrize("args, env, message", [
    (["--threads", "0"], None, "error: Invalid value for '--threads'"),
    ([], "many", "error: PROBE_THREADS='many': give a whole number of threads, at least 1"),
])
def test_a_bad_count_is_one_line(args: list[str], env: str | None, message: str, capsys, monkeypatch) -> None:
    if env is not None:
        monkeypatch.setenv(threads.ENV, env)
    code, _, err = run_cli([*args, "classify", "--model", PLANTED], capsys, monkeypatch)
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith(message), err


@pytest.mark.parametrize("before, omp, picked", [(None, None, 1), (3, None, 3), (None, "2", threads.TORCH_DEFAULT)])
def test_load_model_picks_the_threads_unless_the_caller_chose_them(before: int | None, omp: str | None, picked: int,
                                                                   monkeypatch) -> None:
    """The Python API computes on the free CPUs as the CLI does, unless a count was set (torch or OMP_NUM_THREADS)."""
    from conftest import tiny_hf
    from probe import load_model

    machine(monkeypatch, 2, 0.0, sampled=1.0)  # one of two CPUs busy now
    monkeypatch.setattr(threads, "_chosen", [])
    torch.set_num_threads(threads.TORCH_DEFAULT if before is None else before)
    if omp is not None:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    load_model(tiny_hf("gpt2"), name="tiny")
    assert torch.get_num_threads() == picked

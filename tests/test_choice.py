"""The one rule that chooses a probe set from a command's inputs, and the one name of a sweep's cache file: `probe
ablate`, `probe steer`, `probe prune` and `probe patch` all ask these."""

from __future__ import annotations

from pathlib import Path

import pytest

from probe.ablation.stream import cached_results_path
from probe.inputs import CONTRAST_TASKS, PROBE_SETS
from probe.inputs.choice import data_file, probe_set_name


def test_data_names_a_generated_text_or_a_file() -> None:
    assert data_file("natural") is None and data_file("repeated") is None
    assert data_file("corpus.txt") == Path("corpus.txt")


@pytest.mark.parametrize(("data", "given", "contrast", "expected"), [
    ("natural", {}, False, "natural"),
    ("repeated", {}, False, "repeated"),
    ("corpus.txt", {}, False, "natural"),  # a file is natural text
    ("natural", {"labels": Path("l.jsonl")}, False, "labels"),
    ("natural", {"seq2seq": Path("p.jsonl")}, False, "seq2seq"),  # ablate: an encoder-decoder's source/target texts
    ("natural", {"pairs": Path("p.jsonl")}, False, "contrast"),  # clean/corrupt pairs, whoever measures them
    ("natural", {"task": "sva"}, False, "task"),
    ("natural", {"pairs": Path("p.jsonl")}, True, "contrast"),  # steer: contrast pairs
    ("natural", {"task": "my_task.jsonl"}, True, "task"),  # a task file is no contrast task
    ("natural", {"labels": Path("l.jsonl")}, True, "labels"),
    ("natural", {"labels": Path("l.jsonl"), "compared": True}, True, "class_contrast"),  # patch: a classifier's pairs
    ("natural", {"task": "sva", "compared": True}, True, "contrast"),  # patch, dla: a task's clean/corrupt pairs
])
def test_the_inputs_choose_one_registered_set(data: str, given: dict, contrast: bool, expected: str) -> None:
    name = probe_set_name(data, contrast=contrast, **given)
    assert name == expected and name in PROBE_SETS


@pytest.mark.parametrize("task", sorted(CONTRAST_TASKS))
def test_a_contrast_task_is_contrast_pairs_only_where_a_logit_difference_is_measured(task: str) -> None:
    assert probe_set_name("natural", task=task, contrast=True) == "contrast"
    assert probe_set_name("natural", task=task) == "task"


def test_the_cache_file_is_named_by_everything_in_the_key(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path))
    key = {"command": "steer", "model": "tiny", "batch_size": 2}
    path = cached_results_path(key)
    assert path.parent == tmp_path / "ablate" and path.suffix == ".jsonl"
    assert cached_results_path(dict(reversed(key.items()))) == path  # the order of the key's entries does not count
    assert cached_results_path({**key, "batch_size": 4}) != path


def test_a_run_of_another_kind_is_cached_in_its_own_folder(tmp_path: Path, monkeypatch) -> None:
    """probe track's runs: the same naming, their own folder and stem."""
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path))
    key = {"checkpoints": "run/step-*", "seed": 0}
    path = cached_results_path(key, folder="track", stem="run")
    assert path.parent == tmp_path / "track" and path.name.startswith("run-") and path.suffix == ".jsonl"
    assert path.name.removeprefix("run-") == cached_results_path(key).name.removeprefix("sweep-")

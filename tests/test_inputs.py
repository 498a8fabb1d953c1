"""The inputs package: every kind of input is a probe set in one registry, built by name from ProbeOptions."""

from __future__ import annotations

import json

import pytest
import torch

from probe.ablation.metrics import KINDS, input_kind
from probe.errors import ProbeError
from probe.inputs import (PROBE_SETS, ProbeOptions, build_probe_set, contrast_task, natural_set, read_contrast_pairs,
                          task_set)


def test_every_input_kind_is_registered_and_declares_its_kind() -> None:
    assert {"natural", "repeated", "needle", "task", "seq2seq", "contrast"} <= set(PROBE_SETS)
    for name, entry in PROBE_SETS.items():
        assert entry.name == name and entry.kind in KINDS and entry.summary, name


@pytest.mark.parametrize("name", [name for name, entry in PROBE_SETS.items() if entry.reads])
def test_a_set_that_reads_a_source_refuses_to_build_without_one(smollm2, name) -> None:
    with pytest.raises(ProbeError, match=f"the {name} probe set reads"):
        build_probe_set(name, smollm2, ProbeOptions())


def test_contrast_by_name_equals_the_builders(smollm2, tmp_path) -> None:
    built = build_probe_set("contrast", smollm2, ProbeOptions(task="ioi", num_seqs=6, seed=3))
    direct = contrast_task(smollm2, "ioi", count=6, seed=3)
    assert torch.equal(built.clean, direct.clean) and torch.equal(built.corrupt, direct.corrupt)
    assert torch.equal(built.answer, direct.answer) and built.pairs == direct.pairs
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(vars(pair)) + "\n" for pair in direct.pairs[:3]))
    from_file = build_probe_set("contrast", smollm2, ProbeOptions(pairs=path, task="ioi"))  # the file wins
    assert torch.equal(from_file.clean, read_contrast_pairs(smollm2, path).clean) and len(from_file) == 3


def test_task_and_natural_by_name_are_the_kind_their_entry_declares(smollm2) -> None:
    task = build_probe_set("task", smollm2, ProbeOptions(task="sva", num_seqs=4, seed=2))
    assert torch.equal(task.input_ids, task_set(smollm2, "sva", count=4, seed=2).input_ids)
    assert input_kind(smollm2, task) == PROBE_SETS["task"].kind == "task"
    natural = build_probe_set("natural", smollm2, ProbeOptions(seq_len=16, num_seqs=2))
    assert torch.equal(natural.input_ids, natural_set(smollm2, seq_len=16, num_seqs=2).input_ids)
    assert input_kind(smollm2, natural) == PROBE_SETS["natural"].kind == "text"

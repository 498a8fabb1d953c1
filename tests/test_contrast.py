"""Contrast sets (probe.inputs.contrast): clean/corrupt pairs from files and generated tasks, the logit difference, and
the normalised effect."""

from __future__ import annotations

import json

import pytest
import torch

from probe.hooks.run import logits_of, run_model
from probe.inputs import (CONTRAST_TASKS, MIN_GAP, contrast_logit_diffs, contrast_task, ioi_pairs,
                            logit_diff, normalised_effect, read_contrast_pairs, sva_pairs)
from probe.errors import ProbeError


def _write(path, rows) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


IOI_ROW = {"clean": "When Mary and John went to the store, John gave a drink to",
           "corrupt": "When Mary and John went to the store, Anna gave a drink to",
           "answer": " Mary", "distractor": " John"}


def test_ioi_pairs_are_abc_corruptions() -> None:
    for pair in ioi_pairs(12, 0):
        clean, corrupt = pair.clean.split(" "), pair.corrupt.split(" ")
        changed = [i for i, (a, b) in enumerate(zip(clean, corrupt)) if a != b]
        assert len(clean) == len(corrupt) and len(changed) == 1  # one word: the subject's second mention
        subject, third = clean[changed[0]], corrupt[changed[0]]
        assert pair.distractor == f" {subject}" and subject in clean[:changed[0]][:4]
        assert third not in pair.clean and f" {third}" not in (pair.answer, pair.distractor)


def test_sva_pairs_flip_the_subjects_number() -> None:
    for pair in sva_pairs(12, 0):
        subject_clean, subject_corrupt = pair.clean.split()[1], pair.corrupt.split()[1]
        assert subject_clean != subject_corrupt
        assert {subject_clean.rstrip("s"), subject_corrupt.rstrip("s")} == {subject_clean.rstrip("s")}
        plural = subject_clean.endswith("s")
        assert (pair.answer in (" are", " were", " have")) == plural
        assert pair.answer != pair.distractor


@pytest.mark.parametrize("task", sorted(CONTRAST_TASKS))
def test_generated_sets_have_one_length_per_pair_and_differ_where_they_should(smollm2, task) -> None:
    contrast = contrast_task(smollm2, task, count=24, seed=1)
    assert len(contrast) + len(contrast.dropped) == 24 and len(contrast) > 0
    assert torch.equal(contrast.clean * (1 - contrast.mask), torch.zeros_like(contrast.clean))  # right-padded
    assert torch.equal(contrast.corrupt * (1 - contrast.mask), torch.zeros_like(contrast.corrupt))
    differing = (contrast.clean != contrast.corrupt).sum(dim=1)
    assert bool((differing >= 1).all()) and bool((differing <= 2).all())
    assert bool((contrast.answer != contrast.distractor).all())
    assert contrast.clean[0, 0].item() == smollm2.tokenizer.bos_token_id
    for row, pair in enumerate(contrast.pairs):
        assert smollm2.tokenizer.decode(contrast.clean[row, 1:contrast.last[row] + 1]) == pair.clean


def test_a_file_of_pairs(smollm2, tmp_path) -> None:
    path = tmp_path / "pairs.jsonl"
    _write(path, [IOI_ROW, {**IOI_ROW, "answer": " John", "distractor": " Mary"}])
    contrast = read_contrast_pairs(smollm2, path)
    assert len(contrast) == 2 and contrast.answer.tolist() == contrast.distractor.flip(0).tolist()
    clean, corrupt = contrast_logit_diffs(smollm2, contrast)
    logits = logits_of(run_model(smollm2.model, contrast.clean, contrast.mask))
    assert torch.allclose(clean, logit_diff(logits, contrast), atol=1e-5)
    assert float(clean[0]) == pytest.approx(-float(clean[1]), abs=1e-5)  # answer and distractor swapped
    assert clean[0] > 1.0 and abs(corrupt[0]) < clean[0]  # SmolLM2 does IOI; the ABC corruption takes it away


@pytest.mark.parametrize(("row", "message"), [
    ({**IOI_ROW, "corrupt": "When Mary and John went to the store, Annabella Smith gave a drink to"},
     r"line 2: clean is \d+ tokens and corrupt \d+"),
    ({**IOI_ROW, "answer": " Maryanne-Louise"}, "line 2: answer ' Maryanne-Louise' is"),
    ({"clean": "a", "corrupt": "b", "answer": " c"}, "line 2: no 'distractor'"),
])
def test_bad_rows_are_refused_naming_their_line(smollm2, tmp_path, row, message) -> None:
    path = tmp_path / "pairs.jsonl"
    _write(path, [IOI_ROW, row])
    with pytest.raises(ProbeError, match=message) as error:
        read_contrast_pairs(smollm2, path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_unknown_task_and_missing_file(smollm2, tmp_path) -> None:
    with pytest.raises(ProbeError, match="is not a contrast task"):
        contrast_task(smollm2, "nope")
    with pytest.raises(ProbeError, match="pairs file not found"):
        read_contrast_pairs(smollm2, tmp_path / "missing.jsonl")


def test_normalised_effect() -> None:
    clean, corrupt = torch.tensor([3.0, 5.0]), torch.tensor([0.0, 1.0])
    assert normalised_effect(clean, clean, corrupt) == pytest.approx(1.0)
    assert normalised_effect(corrupt, clean, corrupt) == pytest.approx(0.0)
    assert normalised_effect(torch.tensor([2.0, 2.0]), clean, corrupt) == pytest.approx((2.0 - 0.5) / 3.5)
    with pytest.raises(ProbeError, match="too close"):
        normalised_effect(1.0, torch.tensor([1.0, 1.02]), torch.tensor([1.0 + MIN_GAP / 4]))

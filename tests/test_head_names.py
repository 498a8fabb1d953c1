"""One name of a head in every table the library writes (`L5H1`, `x1.2` on an encoder-decoder): the ablation's
column (`probe.ablation.heads.column_name`, groups of heads too), every result's frame and the tracking rows
(`probe.frames.head_name`) name a head alike, and the reports' own `column_label` (reports import nothing of the
library) writes the same."""

from __future__ import annotations

import pytest

from conftest import tiny_loaded
from probe.ablation.heads import column_name
from probe.frames import head_name
from probe.heads.classify import classify
from probe.reports.labels import column_label
from probe.track.result import CheckpointResult, TrackResult

ENCODER_DECODER = ["enc0", "enc1", "dec0", "x0"]


@pytest.mark.parametrize(("heads", "names", "expected"), [
    ([(5, 1)], None, "L5H1"), ([(5, 1), (18, 6)], None, "L5H1+L18H6"), ([(0, 10)], None, "L0H10"),
    ([(3, 2)], ENCODER_DECODER, "x0.2"), ([(3, 2), (0, 1)], ENCODER_DECODER, "x0.2+enc0.1")])
def test_column_name_cannot_be_read_as_a_number(heads, names, expected) -> None:
    assert column_name(heads, names) == expected


@pytest.mark.parametrize("names", [None, ENCODER_DECODER])
def test_the_reports_write_the_library_s_name(names) -> None:
    for layer in range(4):
        for head in (0, 1, 10):
            assert column_label(layer, head, names) == column_name([(layer, head)], names) == head_name(layer, head,
                                                                                                   names)


def test_classification_frame_and_track_rows_name_heads_as_the_ablation_does() -> None:
    pytest.importorskip("pandas")
    loaded = tiny_loaded("llama_gqa")
    classes = classify(loaded, num_seqs=1, repeat_len=6, seq_len=8)
    frame = classes.to_frame()
    assert list(frame["name"]) == [column_name([(layer, head)]) for layer, head in zip(frame["layer"], frame["head"])]
    entries = [{"layer": layer, "head": head, "scores": {"induction": 0.5}} for layer in range(2) for head in (0, 11)]
    track = TrackResult("tiny", "folders", [CheckpointResult("step-1", 1, None, None, entries)], {}, {}, {})
    assert [row["name"] for row in track.rows()] == ["L0H0", "L0H11", "L1H0", "L1H11"]

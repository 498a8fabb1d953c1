"""`probe classify`: score every head for each head class and label the heads whose score passes the threshold."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from probe.cli.options import (BatchSize, Conllu, CsvFile, Device, DeviceMap, Dtype, Force, HtmlFile, JsonFile, Model,
                               NumSeqs, OffloadFolder, RepeatLen, Seed, SeqLen, TextData, Thresholds, TrustRemoteCode,
                               load, parse_thresholds)
from probe.cli.outputs import check_outputs, save_results, warn_non_finite
from probe.cli.progress import console, progress_bar, status
from probe.errors import ProbeError
from probe.heads.classify import Classification
from probe.heads.classify import classify as run_classify
from probe.heads.scores import SCORES
from probe.inputs import DEFAULT_NUM_SEQS, DEFAULT_REPEAT_LEN, DEFAULT_SEED, DEFAULT_SEQ_LEN
from probe.models import DEFAULT_MODEL, LoadedModel
from probe.patterns import classification_patterns
from probe.syntax import read_conllu, syntax_scores
from probe.syntax.result import add_syntactic
from probe.reports.html import classification_page
from probe.reports.terminal import classification_report, classification_rows


HeadClasses = Annotated[Optional[list[str]], typer.Option(
    "--class", help="Also score this head class (repeatable): " + ", ".join(
        name for name, score in SCORES.items() if not score.by_default) + " are not scored by default.")]


def chosen_scores(extra: list[str]) -> list[str] | None:
    """The classes to score: those scored by default, and each --class (None: the default ones alone)."""
    unknown = [name for name in extra if name not in SCORES]
    if unknown:
        raise ProbeError(f"--class {unknown[0]!r}: choose from {', '.join(SCORES)}")
    if not extra:
        return None
    names = [name for name, score in SCORES.items() if score.by_default]
    return names + [name for name in dict.fromkeys(extra) if name not in names]


def html_page(loaded: LoadedModel, result: Classification, *, data: Path | None, seq_len: int, repeat_len: int,
              seed: int) -> str:
    """The classification page, with each flagged head's pattern on the probe input that earned its label."""
    with status("capturing the patterns of flagged heads ..."):
        patterns = classification_patterns(loaded, result, data=data, seq_len=seq_len, repeat_len=repeat_len,
                                           seed=seed)
    return classification_page(result.to_dict(), {name: block.page_payload() for name, block in patterns.items()})


def classify(
    model: Model = DEFAULT_MODEL, trust_remote_code: TrustRemoteCode = False, data: TextData = None,
    seq_len: SeqLen = DEFAULT_SEQ_LEN, num_seqs: NumSeqs = DEFAULT_NUM_SEQS, repeat_len: RepeatLen = DEFAULT_REPEAT_LEN,
    seed: Seed = DEFAULT_SEED, threshold: Thresholds = None, json_path: JsonFile = None,
    html_path: HtmlFile = None, batch_size: BatchSize = 8, device: Device = None, dtype: Dtype = "float32",
    device_map: DeviceMap = None, offload_folder: OffloadFolder = None, force: Force = False,
    conllu: Conllu = None, csv_path: CsvFile = None, head_class: HeadClasses = None,
) -> None:
    # its help, `probe classify --help`'s first line, is set below: the classes come from the registry
    thresholds = parse_thresholds(threshold or [])
    scores = chosen_scores(head_class or [])
    check_outputs({"--json": json_path, "--csv": csv_path, "--html": html_path}, force=force)
    sentences = read_conllu(conllu) if conllu is not None else None
    loaded = load(model, device, dtype, device_map, offload_folder, trust_remote_code)
    with progress_bar("classifying heads") as update:
        result = run_classify(loaded, data=data, seq_len=seq_len, num_seqs=num_seqs, repeat_len=repeat_len,
                              seed=seed, thresholds=thresholds, scores=scores, batch_size=batch_size,
                              progress=update)
    if sentences is not None:
        with progress_bar("scoring syntactic heads") as update:
            add_syntactic(result, syntax_scores(loaded, sentences, scheme="ud", source=f"CoNLL-U file {conllu}",
                                                batch_size=batch_size, progress=update))
    payload = result.to_dict()
    save_results(payload, "classify", json_path, csv_path, html_path, rows=classification_rows,
                 page=lambda _: html_page(loaded, result, data=data, seq_len=seq_len, repeat_len=repeat_len, seed=seed))
    warn_non_finite(payload)
    unscored = [name for name in SCORES if name not in payload["classes"]]
    classification_report(payload, console, also=[f"--class {name}" for name in unscored])


classify.__doc__ = "Score every head ({}) and label them.".format(", ".join(  # the classes scored by default
    name.replace("_", "-") for name, score in SCORES.items() if score.by_default))

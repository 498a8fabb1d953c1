"""`probe syntax`: which heads follow syntactic dependencies, on CoNLL-U parses or text parsed with spaCy."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from probe.cli.options import (BatchSize, Conllu, CsvFile, Device, DeviceMap, Dtype, Force, HtmlFile, JsonFile, Model,
                               OffloadFolder, TextFile, TrustRemoteCode, load)
from probe.cli.outputs import check_outputs, save_results
from probe.cli.progress import console, progress_bar, status, warn
from probe.inputs import ENGLISH
from probe.errors import ProbeError
from probe.models import DEFAULT_MODEL
from probe.syntax import Sentence, read_conllu, syntax_scores
from probe.syntax.scores import CONFIDENT, MARGIN, MIN_COUNT
from probe.reports.syntax import syntax_page, syntax_report, syntax_rows

MaxSentences = Annotated[int, typer.Option("--max-sentences", help="Sentences scored at most.")]
Margin = Annotated[float, typer.Option("--margin", help="Accuracy above the baseline that makes a head syntactic.")]
MinCount = Annotated[int, typer.Option("--min-count", help="Arcs a relation needs (per direction) to be judged.")]
Confident = Annotated[float, typer.Option(
    "--confident", help="Attention weight above which Vig & Belinkov's confident share counts it.")]


def read_parses(conllu: Path | None, text: Path | None, max_sentences: int) -> tuple[list[Sentence], str, str]:
    """(sentences, label scheme, where they come from): CoNLL-U as given, or text parsed with spaCy."""
    if conllu is not None and text is not None:
        raise ProbeError("give --conllu or --file, not both")
    if conllu is not None:
        return read_conllu(conllu)[:max_sentences], "ud", f"CoNLL-U file {conllu}"
    from probe.syntax.parse import parse_text  # here, not at the top: spaCy is an optional extra

    source = f"text file {text}, parsed by spaCy" if text else "embedded English text, parsed by spaCy"
    raw = (text or ENGLISH).read_text(encoding="utf-8")  # a --file is read first by check_before_loading
    with status("parsing with spaCy ..."):
        sentences = parse_text(raw, source=str(text or ENGLISH.name), max_sentences=max_sentences)
    return sentences, "clearnlp", source


def syntax(
    model: Model = DEFAULT_MODEL, trust_remote_code: TrustRemoteCode = False, conllu: Conllu = None,
    file: TextFile = None, max_sentences: MaxSentences = 200, margin: Margin = MARGIN, min_count: MinCount = MIN_COUNT,
    confident: Confident = CONFIDENT, json_path: JsonFile = None, csv_path: CsvFile = None, html_path: HtmlFile = None,
    batch_size: BatchSize = 8, device: Device = None, dtype: Dtype = "float32", device_map: DeviceMap = None,
    offload_folder: OffloadFolder = None, force: Force = False,
) -> None:
    """Find syntactic heads: per dependency relation, each head's accuracy at attending to the related word, against
    the best fixed-offset baseline."""
    check_outputs({"--json": json_path, "--csv": csv_path, "--html": html_path}, force=force)
    sentences, scheme, source = read_parses(conllu, file, max_sentences)
    loaded = load(model, device, dtype, device_map, offload_folder, trust_remote_code)
    with progress_bar("scoring sentences", "sentences") as update:
        result = syntax_scores(loaded, sentences, scheme=scheme, source=source, batch_size=batch_size,
                               min_count=min_count, margin=margin, confident=confident, progress=update)
    payload = result.to_dict()
    for line in result.skipped:
        warn(line)
    save_results(payload, "syntax", json_path, csv_path, html_path, rows=syntax_rows, page=syntax_page)
    syntax_report(payload, console)

"""`probe compare A B`: two head maps (probe's JSON, DuoAttention, Retrieval_Head, tensors) head by head."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Annotated, Optional

import typer

from probe.cli.options import CsvFile, Force, HtmlFile, JsonFile, MapThresholds, Top
from probe.cli.outputs import check_outputs, save_results
from probe.cli.progress import console
from probe.errors import ProbeError
from probe.headmaps import FORMATS, GROUPINGS, HeadMap, compare as compare_maps, read_map
from probe.provenance import DISTRIBUTION, command_line, utc_now, version_of
from probe.reports.compare import compare_page, compare_report, compare_rows
from probe.reports.files import stamp_outputs

FORMAT_LIST = "; ".join(f"{name} ({entry.convention})" for name, entry in FORMATS.items())

MapA = Annotated[Path, typer.Argument(help=f"The first head map (A). Formats: {FORMAT_LIST}.", show_default=False)]
MapB = Annotated[Path, typer.Argument(help="The second head map (B); differences are B - A where both hold the same "
                                      "kind of score, ranks otherwise.", show_default=False)]
Score = Annotated[Optional[list[str]], typer.Option(
    "--score", help="The score to read from a file that holds several (probe classify: a class; probe kv-heads: "
    "retrieval, streaming, kv_retrieval, kv_streaming, duo). Once: each map that holds several (a map of one score "
    "reads that one); twice: A's, then B's.")]
Group = Annotated[Optional[str], typer.Option(
    "--group", help=f"Compare a query-head map with a KV-head map over KV heads: {', '.join(GROUPINGS)} over each "
    "KV head's query heads (GQA layout: query head q reads KV head q // (heads / KV heads)).")]
Expand = Annotated[bool, typer.Option(
    "--expand", help="Compare a query-head map with a KV-head map over query heads: each query head takes its KV "
    "head's value.")]
SameKind = Annotated[bool, typer.Option(
    "--same-kind", help="Declare that A and B hold the same kind of score where a file does not say what it holds "
    "(a tensor): B - A is then shown. Maps whose formats name different scores are compared by rank.")]


def _pair(values: list[str] | list[float] | None, flag: str) -> tuple[object, object]:
    """A flag given once (both maps) or twice (A, then B)."""
    if not values:
        return None, None
    if len(values) > 2:
        raise ProbeError(f"{flag} is given {len(values)} times: give it once (both maps) or twice (A, then B)")
    return values[0], values[-1]


def _read(path: Path, score: str | None, shared: bool) -> HeadMap:
    """The map in `path`; a score given once for both is for the maps that hold several."""
    try:
        return read_map(path, score)
    except ProbeError as error:
        if not shared or error.parameter != "score":
            raise
        try:
            return read_map(path)
        except ProbeError:
            raise error from None


def compare(
    a: MapA, b: MapB, score: Score = None, group: Group = None, expand: Expand = False, threshold: MapThresholds = None,
    top: Top = 10, same_kind: SameKind = False, json_path: JsonFile = None, csv_path: CsvFile = None,
    html_path: HtmlFile = None, force: Force = False,
) -> None:
    """Compare two head maps: per-head differences (B - A) where both hold the same kind of score (else ranks),
    Spearman and Pearson correlation, overlap of the top heads and of the labelled sets; query heads against KV
    heads only with --group or --expand."""
    score_a, score_b = _pair(score, "--score")
    threshold_a, threshold_b = _pair(threshold, "--threshold")
    check_outputs({"--json": json_path, "--csv": csv_path, "--html": html_path}, force=force)
    shared = score is not None and len(score) == 1
    first, second = _read(a, score_a, shared), _read(b, score_b, shared)  # type: ignore[arg-type]
    thresholds = None if threshold_a is None else (float(threshold_a), float(threshold_b))  # type: ignore[arg-type]
    try:
        payload = compare_maps(first, second, top_k=top, group=group, expand=expand, threshold=thresholds,
                               same_kind=same_kind).to_dict()
    except ProbeError as error:  # the library names its parameters; these are flags here too
        message = str(error).replace(" or expand ", " or --expand ").replace("drop same_kind", "drop --same-kind")
        raise ProbeError(message, parameter=error.parameter) from None
    stamp_outputs({"probe": version_of(DISTRIBUTION), "python": platform.python_version(),  # no model: the maps
                   "command": command_line(), "maps": [str(a), str(b)], "timestamp_utc": utc_now()})
    save_results(payload, "compare", json_path, csv_path, html_path, rows=compare_rows, page=compare_page)
    compare_report(payload, console)

"""`probe track`: head scores, loss and ICL score per checkpoint of a training run, and their phase changes."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from probe.cli.options import (BatchSize, CsvFile, Device, Dtype, Force, Heads, HtmlFile, JsonFile, NumSeqs, RepeatLen,
                               Results, Resume, Seed, SeqLen, TextData, Thresholds, TrackedModel, TrustRemoteCode,
                               parse_thresholds)
from probe.cli.outputs import check_sweep_outputs, record_provenance, save_results
from probe.cli.progress import console, note, progress_bar, saved_on_interrupt, warn
from probe.inputs import (DEFAULT_NUM_SEQS, DEFAULT_REPEAT_LEN, DEFAULT_SEED, DEFAULT_SEQ_LEN)
from probe.distributed import current
from probe.errors import ProbeError
from probe.models import LoadedModel
from probe.ablation.stream import cached_results_path
from probe.reports.track import track_page, track_report
from probe.track import MIN_RISE, TrackOptions, find_run, read_track, track as run_track
from probe.track.icl import EARLY, ICL_SEQS, LATE

Checkpoints = Annotated[Optional[str], typer.Option(
    "--checkpoints", help="Glob of the checkpoints, quoted: model folders ('run/step-*') or state-dict files "
    "('ckpt/*.pt', with --model FILE.py:FUNCTION); ordered by the last number in each name.")]
Revisions = Annotated[Optional[str], typer.Option(
    "--revisions", help="The hub model's revisions to track, comma-separated (step1000,step2000,...).")]
IclPositions = Annotated[str, typer.Option(
    "--icl-positions", help="EARLY,LATE: the in-context learning score is the loss on token LATE minus the loss on "
    "token EARLY (Olsson et al. 2022).")]
IclSeqs = Annotated[int, typer.Option("--icl-seqs", help="Texts the in-context learning score averages over.")]
MinRise = Annotated[float, typer.Option(
    "--min-rise", help="The smallest rise of a class's best head score between two checkpoints that is a phase "
    "change.")]


def parse_positions(text: str) -> tuple[int, int]:
    """--icl-positions EARLY,LATE."""
    early, _, late = text.partition(",")
    try:
        return int(early), int(late)
    except ValueError:
        raise ProbeError(f"--icl-positions takes EARLY,LATE token indices, e.g. 50,500; got {text!r}") from None


def track(
    model: TrackedModel = None, checkpoints: Checkpoints = None, revisions: Revisions = None,
    trust_remote_code: TrustRemoteCode = False, data: TextData = None, seq_len: SeqLen = DEFAULT_SEQ_LEN,
    num_seqs: NumSeqs = DEFAULT_NUM_SEQS, repeat_len: RepeatLen = DEFAULT_REPEAT_LEN, seed: Seed = DEFAULT_SEED,
    threshold: Thresholds = None, icl_positions: IclPositions = f"{EARLY},{LATE}", icl_seqs: IclSeqs = ICL_SEQS,
    heads: Heads = None, min_rise: MinRise = MIN_RISE, results: Results = None, resume: Resume = False,
    json_path: JsonFile = None, csv_path: CsvFile = None, html_path: HtmlFile = None, batch_size: BatchSize = 8,
    device: Device = None, dtype: Dtype = "float32", force: Force = False,
) -> None:
    """Score every head of each checkpoint of a training run; find where each class and in-context learning jump."""
    early, late = parse_positions(icl_positions)
    options = TrackOptions(data=None if data is None else str(data), seq_len=seq_len, num_seqs=num_seqs,
                           repeat_len=repeat_len, seed=seed, thresholds=parse_thresholds(threshold or []),
                           batch_size=batch_size, early=early, late=late, icl_seqs=icl_seqs, heads=heads or "",
                           min_rise=min_rise)
    check_sweep_outputs({"--json": json_path, "--csv": csv_path, "--html": html_path}, results, resume=resume,
                        force=force, writes=True)
    run = find_run(model, checkpoints=checkpoints, revisions=revisions)
    stream = results or cached_results_path({"run": run.to_dict(), "options": options.to_dict(), "dtype": dtype},
                                            folder="track", stem="run")
    stream.parent.mkdir(parents=True, exist_ok=True)
    rank = current()
    main_process = rank is None or rank.is_main
    done_before = len(read_track(stream)[1]) if resume and stream.is_file() and stream.stat().st_size else 0
    recorded: list[str] = []

    def on_model(loaded: LoadedModel) -> None:  # the files' provenance: the first checkpoint's model
        if not recorded:
            record_provenance(loaded)
            recorded.append(loaded.name)

    with saved_on_interrupt(stream, lambda: "the finished checkpoints", main_process), \
            progress_bar("tracking", "checkpoints") as update:
        result = run_track(run, options, results_path=stream, resume=resume, progress=update, on_model=on_model,
                           dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    if result is None:
        return
    if done_before:
        note(f"resumed: {done_before} checkpoint(s) read from {stream}")
    payload = result.to_dict()
    save_results(payload, "track", json_path, csv_path, html_path, rows=lambda _: result.rows(), page=track_page)
    for line in sorted({n for c in payload["checkpoints"] for n in c.get("notes", [])}):
        warn(f"note: {line}")
    track_report(payload, console)
    if results is None:
        stream.unlink(missing_ok=True)  # the cache stream only serves --resume

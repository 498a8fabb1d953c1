"""`probe atlas`: one page where every head's evidence meets (pattern, weights, cause)."""

from __future__ import annotations

from typing import Annotated

import typer

from probe.atlas import atlas as build_atlas
from probe.atlas.run import DEFAULT_NUM_SEQS, STAGE_UNITS
from probe.cli.options import (BatchSize, Count, Device, DeviceMap, Dtype, Force, HtmlFile, JsonFile, Model, NumSeqs,
                               OffloadFolder, RepeatLen, Results, Resume, Seed, SelfRepair, SeqLen, Task, TextData,
                               Thresholds, TrustRemoteCode, load, parse_thresholds)
from probe.cli.outputs import check_outputs, save_results, warn_non_finite
from probe.cli.progress import console, progress_bar
from probe.inputs import DEFAULT_REPEAT_LEN, DEFAULT_SEED, DEFAULT_SEQ_LEN
from probe.errors import ProbeError
from probe.models import DEFAULT_MODEL
from probe.reports.atlas import atlas_page, atlas_report

Fast = Annotated[bool, typer.Option(
    "--fast", help="Estimate the ablation deltas on natural text (attribution patching, ~10 forward-equivalents) "
    "instead of the exact sweep; the page marks them estimated. A --task sweep stays exact.")]


def atlas(
    model: Model = DEFAULT_MODEL, trust_remote_code: TrustRemoteCode = False, data: TextData = None,
    seq_len: SeqLen = DEFAULT_SEQ_LEN, num_seqs: NumSeqs = DEFAULT_NUM_SEQS, repeat_len: RepeatLen = DEFAULT_REPEAT_LEN,
    seed: Seed = DEFAULT_SEED, threshold: Thresholds = None, task: Task = None, count: Count = 32, fast: Fast = False,
    results: Results = None, resume: Resume = False, self_repair: SelfRepair = False, json_path: JsonFile = None,
    html_path: HtmlFile = None,
    batch_size: BatchSize = 8, device: Device = None, dtype: Dtype = "float32", device_map: DeviceMap = None,
    offload_folder: OffloadFolder = None, force: Force = False,
) -> None:
    """Every head's classes, each label checked against its weights and its causal effect, examples over the data,
    what it writes, its composition partners and its ablation effects: one offline page (--html) and JSON."""
    thresholds = parse_thresholds(threshold or [])
    if resume and results is None:
        raise ProbeError("--resume continues the sweeps kept in a --results folder: give --results")
    check_outputs({"--json": json_path, "--html": html_path}, force=force)
    loaded = load(model, device, dtype, device_map, offload_folder, trust_remote_code)
    with progress_bar("atlas", STAGE_UNITS) as bars:
        result = build_atlas(loaded, data=data, seq_len=seq_len, num_seqs=num_seqs, repeat_len=repeat_len, seed=seed,
                             thresholds=thresholds, task=task, task_count=count, fast=fast, batch_size=batch_size,
                             results_dir=results, resume=resume, progress=bars and bars.stage, self_repair=self_repair)
    payload = result.to_dict()
    save_results(payload, "atlas", json_path, html_path=html_path, page=lambda p: atlas_page(
        p, {name: block.page_payload() for name, block in result.patterns.items()}))
    warn_non_finite(payload)
    atlas_report(payload, console)

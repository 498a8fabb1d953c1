"""`probe circuits`: induction heads, the earlier heads feeding their keys (K-composition), and an ablation check."""

from __future__ import annotations

from typing import Annotated

import typer

from probe.cli.options import (BatchSize, CsvFile, Device, DeviceMap, Dtype, Force, HtmlFile, JsonFile, Model, NumSeqs,
                               OffloadFolder, RepeatLen, Seed, SeqLen, Top, TrustRemoteCode, load)
from probe.cli.outputs import check_outputs, save_results
from probe.cli.progress import console, progress_bar
from probe.circuits.pairs import STAGE_UNITS
from probe.circuits.pairs import circuits as find_circuits
from probe.inputs import DEFAULT_NUM_SEQS, DEFAULT_REPEAT_LEN, DEFAULT_SEED
from probe.models import DEFAULT_MODEL
from probe.reports.circuits import circuit_rows, circuits_page, circuits_report

NoCheck = Annotated[bool, typer.Option("--no-check", help="Skip the ablation check (weights and classification only).")]


def circuits(
    model: Model = DEFAULT_MODEL, trust_remote_code: TrustRemoteCode = False, top: Top = 3, no_check: NoCheck = False,
    seq_len: SeqLen = 128, num_seqs: NumSeqs = DEFAULT_NUM_SEQS, repeat_len: RepeatLen = DEFAULT_REPEAT_LEN,
    seed: Seed = DEFAULT_SEED, json_path: JsonFile = None, csv_path: CsvFile = None, html_path: HtmlFile = None,
    batch_size: BatchSize = 8,
    device: Device = None, dtype: Dtype = "float32", device_map: DeviceMap = None,
    offload_folder: OffloadFolder = None, force: Force = False,
) -> None:
    """Induction heads and the earlier heads that feed their keys (K-composition, Elhage et al. 2021), marked when
    they are previous-token heads, each pair ablated together vs alone on the repeated set."""
    check_outputs({"--json": json_path, "--csv": csv_path, "--html": html_path}, force=force)
    loaded = load(model, device, dtype, device_map, offload_folder, trust_remote_code)
    with progress_bar("circuits", STAGE_UNITS) as bars:
        result = find_circuits(loaded, top=top, check=not no_check, seq_len=seq_len, num_seqs=num_seqs,
                               repeat_len=repeat_len, seed=seed, batch_size=batch_size, progress=bars and bars.stage)
    payload = result.to_dict()
    save_results(payload, "circuits", json_path, csv_path, html_path, rows=circuit_rows, page=circuits_page)
    circuits_report(payload, console)

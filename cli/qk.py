"""`probe qk`: a head's scores split into pairs of query-side and key-side residual components."""

from __future__ import annotations

import re
from typing import Annotated, Optional

import typer

from probe.cli.checks import model_config
from probe.cli.options import (CsvFile, Data, Device, DeviceMap, Dtype, Force, HtmlFile, JsonFile, Model, NumSeqs,
                               OffloadFolder, RepeatLen, Seed, SeqLen, Top, TrustRemoteCode, load)
from probe.cli.outputs import check_outputs, save_results
from probe.cli.progress import console, progress_bar
from probe.errors import ProbeError
from probe.inputs import DEFAULT_REPEAT_LEN, DEFAULT_SEQ_LEN, ProbeOptions, build_probe_set
from probe.inputs.choice import GENERATED, probe_set_name
from probe.models import DEFAULT_MODEL
from probe.qk import KEY_RULES, config_refusal, qk_attribution
from probe.reports.qk import qk_page, qk_report, qk_rows

HeadSpec = Annotated[str, typer.Option("--head", help="The head whose scores are split, as LAYER.HEAD (17.3).")]
At = Annotated[str, typer.Option("--at", help="Which key each query is read at: " + "; ".join(
    f"{rule.name}: {rule.summary}" for rule in KEY_RULES.values()) + ".")]
Query = Annotated[Optional[int], typer.Option("--query", help="Read one query position (with --key) on every row.")]
Key = Annotated[Optional[int], typer.Option("--key", help="The key position read with --query.")]
HEAD = re.compile(r"(\d+)\.(\d+)")


def _head(spec: str) -> tuple[int, int]:
    found = HEAD.fullmatch(spec.strip())
    if found is None:
        raise ProbeError(f"--head {spec!r}: give one head as LAYER.HEAD, e.g. 17.3")
    return int(found[1]), int(found[2])


def qk(
    head: HeadSpec, model: Model = DEFAULT_MODEL, trust_remote_code: TrustRemoteCode = False, at: At = "attended",
    query: Query = None, key: Key = None, data: Data = "repeated", num_seqs: NumSeqs = 4,
    repeat_len: RepeatLen = DEFAULT_REPEAT_LEN, seq_len: SeqLen = DEFAULT_SEQ_LEN, seed: Seed = 0, top: Top = 10,
    json_path: JsonFile = None, csv_path: CsvFile = None, html_path: HtmlFile = None, device: Device = None,
    dtype: Dtype = "float32", device_map: DeviceMap = None, offload_folder: OffloadFolder = None, force: Force = False,
) -> None:
    """QK attribution: a head's scores from each query to the key it reads (the key it attends to most, the key
    its class predicts, or --query/--key) as a sum over pairs of residual components, through the norm frozen at the
    run; the pairs sum to the model's own score. Also the contrast: that key's score minus the other keys' mean."""
    layer_head = _head(head)
    if (query is None) != (key is None):
        raise ProbeError("give --query and --key together (one position each), or neither")
    why = config_refusal(model_config(model) or {})
    if why:
        raise ProbeError(why)
    check_outputs({"--json": json_path, "--csv": csv_path, "--html": html_path}, force=force)
    loaded = load(model, device, dtype, device_map, offload_folder, trust_remote_code)
    probe_set = build_probe_set(probe_set_name(data), loaded, ProbeOptions(
        None if data in GENERATED else data, seq_len, num_seqs, repeat_len, seed))
    with progress_bar("qk") as update:
        result = qk_attribution(loaded, probe_set.input_ids, layer_head, mask=probe_set.attention_mask, at=at,
                                query=query, key=key, source=probe_set.description, progress=update)
    payload = result.to_dict()
    save_results(payload, "qk", json_path, csv_path, html_path, rows=qk_rows, page=qk_page)
    qk_report(payload, console, top=top)

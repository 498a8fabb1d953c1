"""`probe headvis`: Neuronpedia HeadVis's six metrics of every head, as probe's files or Neuronpedia's."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Optional

import typer

from probe.cli.options import (BatchSize, CsvFile, Device, DeviceMap, Dtype, Force, JsonFile, Model, NumSeqs,
                               OffloadFolder, Seed, SeqLen, TextData, TrustRemoteCode, load)
from probe.cli.outputs import check_outputs, save, save_json
from probe.cli.progress import console, progress_bar
from probe.errors import ProbeError
from probe.headvis import METRICS, head_metrics
from probe.headvis.tree import neuronpedia_json, write_tree
from probe.inputs import DEFAULT_NUM_SEQS, DEFAULT_SEQ_LEN, ProbeOptions, build_probe_set
from probe.models import DEFAULT_MODEL
from probe.reports.files import write_csv, write_json
from probe.reports.labels import precision_sentence, short_label

NeuronpediaJson = Annotated[Optional[Path], typer.Option(
    "--neuronpedia-json", help="Write Neuronpedia's head-metrics JSON: {config, metrics: {name: layers x heads}}.")]
Tree = Annotated[Optional[Path], typer.Option(
    "--tree", help="Write the HeadVis frontend's data tree into this folder (config.json, scatter_data.json and a "
    "file per head under heads/).")]
Samples = Annotated[int, typer.Option(
    "--samples", help="Sequences whose attention the data tree shows (their top weights per row).")]


def headvis(
    model: Model = DEFAULT_MODEL, trust_remote_code: TrustRemoteCode = False, data: TextData = None,
    seq_len: SeqLen = DEFAULT_SEQ_LEN, num_seqs: NumSeqs = DEFAULT_NUM_SEQS, seed: Seed = 0,
    batch_size: BatchSize = 8, samples: Samples = 4, json_path: JsonFile = None, csv_path: CsvFile = None,
    neuronpedia_path: NeuronpediaJson = None, tree: Tree = None, device: Device = None, dtype: Dtype = "float32",
    device_map: DeviceMap = None, offload_folder: OffloadFolder = None, force: Force = False,
) -> None:
    """HeadVis's six metrics per head (self attention, previous token, entropy, query-key distance and its variance,
    induction on the text itself), as Neuronpedia's HeadVis pipeline defines them, without forming attention
    weights."""
    if samples < 0:
        raise ProbeError(f"--samples must be at least 0, got {samples}")
    check_outputs({"--json": json_path, "--csv": csv_path, "--neuronpedia-json": neuronpedia_path}, force=force)
    if tree is not None and tree.exists() and (not tree.is_dir() or any(tree.iterdir())) and not force:
        raise ProbeError(f"--tree {tree} exists and is not an empty folder: give --force to write into it")
    loaded = load(model, device, dtype, device_map, offload_folder, trust_remote_code)
    probe_set = build_probe_set("natural", loaded, ProbeOptions(data=data, seq_len=seq_len, num_seqs=num_seqs,
                                                                seed=seed))
    with progress_bar("headvis") as update:
        result = head_metrics(loaded, probe_set, batch_size=batch_size, samples=samples if tree else 0,
                              progress=update)
    save_json(json_path, result.to_dict(), "headvis")
    save(csv_path, lambda path: write_csv(path, result.to_frame().to_dict(orient="records")))
    save(neuronpedia_path, lambda path: write_json(path, neuronpedia_json(result), schema=None, stamp=False))
    save(tree, lambda path: write_tree(result, path))
    console.print(f"{result.model}: {result.counts['sequences']} sequences, {result.counts['queries']} tokens "
                  f"({result.path})")
    for name in METRICS:
        values = result.metrics[name]
        flat = values.nan_to_num(-math.inf).flatten()
        top = flat.topk(min(3, len(flat))).indices.tolist()
        heads = ", ".join(f"{short_label(index // values.shape[1], index % values.shape[1])} {float(flat[index]):.3f}"
                          for index in top)
        console.print(f"  {name:22} top: {heads}")
    console.print(precision_sentence({"dtype": result.dtype}))

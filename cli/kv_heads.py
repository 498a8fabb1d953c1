"""`probe kv-heads`: a full / streaming label per KV head, and the maps KV-cache compression methods load."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from probe.cli.options import (Device, DeviceMap, Dtype, Force, HtmlFile, JsonFile, Model, OffloadFolder, Seed,
                               TextData, TrustRemoteCode, load)
from probe.cli.outputs import check_outputs, save, save_json, save_results
from probe.cli.progress import console, progress_bar
from probe.errors import ProbeError
from probe.heads.scores import DEFAULT_RECENT
from probe.headmaps.formats import DUO_CONFIG, DUO_FILE, duo_config, kv_heads_map, razor_map, write_map
from probe.kv import DEFAULT_MAX_LOSS_INCREASE, KV_SINK, kv_heads as run_kv_heads
from probe.kv.pipeline import STAGE_UNITS, check_budget_choice
from probe.models import DEFAULT_MODEL
from probe.inputs import DEFAULT_DEPTHS, DEFAULT_NEEDLE
from probe.reports.files import write_json
from probe.reports.kv_heads import kv_heads_page, kv_heads_report

EXPORTS = ("duo", "razor", "headkv")
"""duo:DIR (DuoAttention), razor:FILE.json (RazorAttention), headkv:FILE.json (HeadKV / Wu et al.)."""

Lengths = Annotated[str, typer.Option("--lengths", help="Needle prompt lengths in tokens, comma-separated.")]
Depths = Annotated[str, typer.Option("--depths", help="Needle depths in [0, 1], comma-separated.")]
Prompts = Annotated[int, typer.Option("--prompts", help="Needle prompts per (length, depth).")]
Needle = Annotated[str, typer.Option("--needle", help="The needle sentence; {key} marks the random number.")]
Sink = Annotated[int, typer.Option("--sink", help="Sink keys a streaming head keeps (the first ones).")]
Recent = Annotated[int, typer.Option("--recent", help="Recent keys a streaming head keeps (its own included).")]
FullFraction = Annotated[Optional[float], typer.Option(
    "--full-fraction", help="A fixed budget: the fraction of KV heads kept full, those retrieval needs most (ignored "
    "with a threshold). Default: a calibrated budget (--max-loss-increase).")]
Order = Annotated[str, typer.Option(
    "--order", help="How KV heads are ordered for streaming: retrieval (retrieval ascending) or loss (the loss change "
    "each causes streamed alone, one window-ablation sweep; retrieving heads last).")]
MaxLossIncrease = Annotated[float, typer.Option(
    "--max-loss-increase", help="The calibrated budget: stream the most KV heads whose measured point keeps needle "
    "accuracy at the model's own and the natural-text loss change within this (held-out prompts and texts).")]
RetrievalThreshold = Annotated[Optional[float], typer.Option(
    "--retrieval-threshold", help="Full where the KV head's retrieval score (max over its group) is above this.")]
StreamingThreshold = Annotated[Optional[float], typer.Option(
    "--streaming-threshold", help="Full where the KV head's streaming score (min over its group) is below this.")]
KvpressRatio = Annotated[Optional[float], typer.Option(
    "--kvpress-ratio", help="The budget for NVIDIA kvpress's DuoAttentionPress removing this fraction of the KV cache "
    "(its compression_ratio) at the longest --lengths: the map streams exactly the KV heads that press streams, and "
    "the head_compression_ratio to pass is printed and written to the export's config.json. Instead of the calibrated "
    "budget; its point is measured.")]
Curve = Annotated[bool, typer.Option("--curve/--no-curve", help="Check the order: stream k = 0 .. all KV heads.")]
Steps = Annotated[int, typer.Option("--steps", help="Points of the curve (k from 0 to all KV heads).")]
EveryRandomPoint = Annotated[bool, typer.Option(
    "--every-random-point", help="Measure every point of the random orders' curves. By default a random order's "
    "curve stops at its first point the budget's rule refuses where probe's order is kept (it is clearly below "
    "there).")]
RandomSeeds = Annotated[str, typer.Option("--random-seeds", help="Seeds of the random orders, comma-separated.")]
CurveTexts = Annotated[int, typer.Option("--curve-texts", help="Natural-text sequences the curve's loss is read on.")]
Export = Annotated[Optional[list[str]], typer.Option(
    "--export", help="FORMAT:PATH (repeatable): duo:DIR (full_attention_heads.tsv + config.json), "
    "razor:FILE.json ({layer: [kv_head, ...]} kept full), headkv:FILE.json ({\"layer-head\": [score]}).")]


def _numbers(text: str, kind: type, parameter: str) -> tuple[Any, ...]:
    try:
        return tuple(kind(item) for item in text.split(",") if item.strip())
    except ValueError:
        raise ProbeError(f"{parameter} takes comma-separated numbers, got {text!r}", parameter=parameter) from None


def parse_exports(items: list[str]) -> dict[str, Path]:
    """FORMAT:PATH items -> {format: path}; one line for a format probe does not write, or one given twice."""
    exports: dict[str, Path] = {}
    for item in items:
        kind, sep, path = item.partition(":")
        if not sep or not path:
            raise ProbeError(f"--export takes FORMAT:PATH, e.g. duo:maps/smollm2; got {item!r}")
        if kind not in EXPORTS:
            raise ProbeError(f"unknown export format {kind!r}: use one of {', '.join(EXPORTS)}")
        if kind in exports:
            raise ProbeError(f"--export {kind} is given twice: give each format once")
        exports[kind] = Path(path)
    return exports


def _export_files(exports: dict[str, Path]) -> dict[str, Path | None]:
    """The files the exports write (a duo folder made as `mkdir -p` would); a file in the way is refused now."""
    files: dict[str, Path | None] = {}
    folder = exports.get("duo")
    if folder is not None:
        existing = next((path for path in (folder, *folder.parents) if path.exists()), None)
        if existing is not None and not existing.is_dir():
            raise ProbeError(f"--export duo names a folder; {existing} is a file")
        if folder.is_dir():
            files["--export duo"] = folder / DUO_FILE
            files["--export duo (config)"] = folder / DUO_CONFIG
            files["--export duo (budget)"] = budget_file(folder)
    for kind in ("razor", "headkv"):
        if kind in exports:
            files[f"--export {kind}"] = exports[kind]
            files[f"--export {kind} (budget)"] = budget_file(exports[kind])
    return files


def budget_file(export: Path) -> Path:
    """Where an export's budget rule is written beside it: DIR/probe_budget.json, or FILE.budget.json."""
    return export / "probe_budget.json" if export.suffix == "" or export.is_dir() else \
        export.with_name(export.stem + ".budget.json")


def _write_exports(exports: dict[str, Path], payload: dict[str, Any], budget: dict[str, Any]) -> None:
    """The maps through the head-map formats' writers, RazorAttention's here, and each export's budget file."""
    source = "probe kv-heads"
    if "duo" in exports:  # full_attention_heads.tsv and config.json (sink_size, recent_size, threshold)
        save(exports["duo"], lambda path: write_map(kv_heads_map(payload, "duo", source), path, "duo",
                                                    settings=duo_config(payload)))
    if "razor" in exports:
        save(exports["razor"], lambda path: write_json(path, razor_map(payload), schema=None, stamp=False))
    if "headkv" in exports:  # Retrieval_Head's {"L-H": [score]}, one line: HeadKV reads the first, in file order
        save(exports["headkv"], lambda path: write_map(kv_heads_map(payload, "retrieval", source), path,
                                                       "retrieval-head"))
    for export in exports.values():  # beside each export: how its budget was chosen
        save_json(budget_file(export), budget, "kv-budget")


DEPTHS = ",".join(f"{depth:g}" for depth in DEFAULT_DEPTHS)  # --depths' default


def kv_heads(
    model: Model = DEFAULT_MODEL, trust_remote_code: TrustRemoteCode = False, lengths: Lengths = "1024",
    depths: Depths = DEPTHS, prompts: Prompts = 1, needle: Needle = DEFAULT_NEEDLE,
    sink: Sink = KV_SINK, recent: Recent = DEFAULT_RECENT, full_fraction: FullFraction = None,
    retrieval_threshold: RetrievalThreshold = None, streaming_threshold: StreamingThreshold = None,
    max_loss_increase: MaxLossIncrease = DEFAULT_MAX_LOSS_INCREASE, kvpress_ratio: KvpressRatio = None,
    order: Order = "retrieval",
    curve: Curve = True, steps: Steps = 5, random_seeds: RandomSeeds = "0,1",
    every_random_point: EveryRandomPoint = False, curve_texts: CurveTexts = 2,
    data: TextData = None, seed: Seed = 0, export: Export = None, json_path: JsonFile = None,
    html_path: HtmlFile = None,
    device: Device = None, dtype: Dtype = "float32", device_map: DeviceMap = None,
    offload_folder: OffloadFolder = None, force: Force = False,
) -> None:
    """Which KV heads can keep only sink + recent keys (streaming) and which need the full cache (retrieval)."""
    exports = parse_exports(export or [])
    sizes = _numbers(lengths, int, "lengths")
    where = _numbers(depths, float, "depths")
    seeds = _numbers(random_seeds, int, "random_seeds")
    check_budget_choice(kvpress_ratio, (full_fraction, retrieval_threshold, streaming_threshold), sizes, sink, recent)
    check_outputs({"--json": json_path, "--html": html_path, **_export_files(exports)}, force=force)
    loaded = load(model, device, dtype, device_map, offload_folder, trust_remote_code)
    with progress_bar("kv-heads", STAGE_UNITS) as bars:
        result = run_kv_heads(loaded, lengths=sizes, depths=where, prompts=prompts, needle=needle, sink=sink,
                              recent=recent, full_fraction=full_fraction, retrieval_threshold=retrieval_threshold,
                              max_loss_increase=max_loss_increase, order_by=order,
                              streaming_threshold=streaming_threshold, curve=curve, steps=steps,
                              random_seeds=seeds, stop_random=not every_random_point, curve_texts=curve_texts,
                              data=None if data is None else str(data), seed=seed, kvpress_ratio=kvpress_ratio,
                              progress=bars and bars.stage)
    payload = result.to_dict()
    save_results(payload, "kv-heads", json_path, html_path=html_path, page=kv_heads_page)
    _write_exports(exports, payload, result.budget_record().to_dict())
    kv_heads_report(payload, console)

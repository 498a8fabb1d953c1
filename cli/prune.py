"""`probe prune`: pruning curves (Michel et al. 2019), heads removed step by step in three orderings."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from probe.cli.options import (BatchSize, CsvFile, Data, Device, DeviceMap, Dtype, Force, HtmlFile, JsonFile, Labels,
                               Method, Metric, Model, NumSeqs, OffloadFolder, Seed, SeqLen, TrustRemoteCode, load)
from probe.cli.outputs import check_outputs, save_results
from probe.cli.progress import console, progress_bar
from probe.ablation.methods import METHODS
from probe.ablation.prune import ORDERINGS, PruneResult, check_prune_options
from probe.ablation.prune import prune as run_prune
from probe.inputs import DEFAULT_NUM_SEQS, DEFAULT_SEED, DEFAULT_SEQ_LEN, ProbeOptions, build_probe_set
from probe.inputs.choice import data_file, probe_set_name
from probe.errors import ProbeError
from probe.models import DEFAULT_MODEL
from probe.reports.labels import precision_clause
from probe.reports.prune import prune_page, prune_verdict

Step = Annotated[float, typer.Option("--step", help="Share of the heads removed per step, e.g. 0.1 (10%).")]
MaxIncrease = Annotated[Optional[str], typer.Option(
    "--max-increase", help="Stop when the loss rises past this: relative with %, e.g. 5%; absolute without, e.g. "
    "0.2. Default: prune to 100%.")]
Orderings = Annotated[str, typer.Option(
    "--orderings", help="Comma-separated: michel (importance recomputed each step), sweep (single-head ablation "
    "order), random.")]
Seeds = Annotated[int, typer.Option("--seeds", help="Random orderings drawn (seeds --seed, --seed + 1, ...).")]
KvGroups = Annotated[bool, typer.Option(
    "--kv-groups", help="Prune whole key/value groups of a grouped-query model (removing query heads alone saves "
    "no key/value compute).")]
EvalData = Annotated[Optional[Path], typer.Option(
    "--eval-data", help="Measure the losses on this UTF-8 text file (same --seq-len / --num-seqs) instead of the "
    "--data the orderings are chosen on: a held-out check.")]


def parse_max_increase(text: str | None) -> tuple[float | None, bool]:
    """'5%' -> (0.05, relative); '0.2' -> (0.2, absolute)."""
    if text is None:
        return None, True
    relative = text.strip().endswith("%")
    try:
        value = float(text.strip().rstrip("%"))
    except ValueError:
        raise ProbeError(f"--max-increase takes 5% (relative) or 0.2 (absolute), got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ProbeError(f"--max-increase must be a finite number >= 0, got {text!r}")
    return (value / 100 if relative else value), relative


def summary(payload: dict, console_, limit: str | None = None) -> None:
    """Per ordering its loss at each step, then in words the most pruned within `limit` (--max-increase)."""
    console_.print(f"[bold]Pruning curves of {payload['model']}[/bold] ({payload['n_units']} "
                   f"{payload['units'].replace('_', ' ')}, baseline loss {payload['baseline_loss']:.4f} "
                   f"({payload['metric']})"
                   f" on {payload['measured_on']})")
    for curve in payload["curves"]:
        name = curve["ordering"] + ("" if curve["seed"] is None else f" (seed {curve['seed']})")
        points = "  ".join(f"{step['share_pruned']:.0%}: {step['loss']:.3f}" for step in curve["steps"][1:])
        console_.print(f"  {name:<18} {points}")
        console_.print(f"  {'':<18} [dim]{curve['stopped']}[/dim]")
    verdict = None if limit is None else prune_verdict(payload, limit)
    if verdict:
        console_.print(f"[bold]{escape(verdict)}[/bold]")
    if payload.get("note"):
        console_.print(f"[dim]{payload['note']}[/dim]")
    costs = payload["costs"]
    console_.print(f"[dim]{payload['seconds']:.1f} s, {costs['forward_equivalents']} forward-equivalents "
                   f"({costs['loss_passes']} loss passes, {costs['gradient_passes']} gradient passes, "
                   f"sweep {costs['sweep_forward_equivalents']}){precision_clause(payload)}[/dim]")


def prune(
    model: Model = DEFAULT_MODEL, trust_remote_code: TrustRemoteCode = False, data: Data = "natural",
    seq_len: SeqLen = DEFAULT_SEQ_LEN, num_seqs: NumSeqs = DEFAULT_NUM_SEQS, seed: Seed = DEFAULT_SEED,
    step: Step = 0.1, max_increase: MaxIncrease = None, orderings: Orderings = ",".join(ORDERINGS),
    seeds: Seeds = 3, method: Method = "zero", metric: Metric = None, kv_groups: KvGroups = False,
    eval_data: EvalData = None, labels: Labels = None, json_path: JsonFile = None,
    csv_path: CsvFile = None, html_path: HtmlFile = None, batch_size: BatchSize = 8, device: Device = None,
    dtype: Dtype = "float32", device_map: DeviceMap = None, offload_folder: OffloadFolder = None, force: Force = False,
) -> None:
    """Prune heads step by step (Michel importance, sweep order, random) and plot the loss against the share pruned."""
    limit, relative = parse_max_increase(max_increase)
    if method not in METHODS:
        raise ProbeError(f"--method {method!r}: use one of {', '.join(METHODS)}")
    chosen = [name.strip() for name in orderings.split(",") if name.strip()]
    check_prune_options(chosen, step, limit, range(seed, seed + seeds))
    if labels is not None and (data != "natural" or eval_data is not None):
        raise ProbeError("--labels replaces --data and --eval-data: give one of them")
    check_outputs({"--json": json_path, "--csv": csv_path, "--html": html_path}, force=force)
    loaded = load(model, device, dtype, device_map, offload_folder, trust_remote_code)
    probe_set = build_probe_set(probe_set_name(data, labels=labels), loaded,
                                ProbeOptions(data=data_file(data), seq_len=seq_len, num_seqs=num_seqs, seed=seed,
                                             labels=labels))
    eval_set = None if eval_data is None else build_probe_set(
        "natural", loaded, ProbeOptions(data=eval_data, seq_len=seq_len, num_seqs=num_seqs, seed=seed))
    with progress_bar("pruning", "steps") as update:
        result: PruneResult = run_prune(loaded, probe_set, orderings=chosen, step=step, max_increase=limit,
                                        relative=relative, seeds=range(seed, seed + seeds), method=method,
                                        metric=metric, method_seed=seed, kv_groups=kv_groups, batch_size=batch_size,
                                        data=data if labels is None else None, eval_set=eval_set,
                                        eval_data=None if eval_data is None else str(eval_data), progress=update)
    payload = result.to_dict()
    save_results(payload, "prune", json_path, csv_path, html_path, rows=lambda _: result.rows(), page=prune_page)
    summary(payload, console, max_increase)
